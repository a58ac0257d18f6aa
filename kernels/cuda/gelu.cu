// GELU, tanh approximation, as kernels/src/ops/gelu.rs computes it operation for operation:
// tanh(u) = 1 - 2 / (exp(2u) + 1), products left to right. Elementwise; bitwise the CPU's up to
// the math library's expf (the CPU's is glibc's, the GPU's CUDA's: 2 ulp).

typedef unsigned long long u64;

#define GELU_SCALE 0.7978846f  // sqrt(2 / pi), the CPU's constant
#define GELU_CUBE 0.044715f

__device__ __forceinline__ float tanh_exp(float u) { return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f); }

// out: (N), inp: (N).
extern "C" __global__ void gelu_forward_f32(float *__restrict__ out, const float *__restrict__ inp, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float x = inp[i];
        const float cube = GELU_CUBE * x * x * x;
        out[i] = 0.5f * x * (1.0f + tanh_exp(GELU_SCALE * (x + cube)));
    }
}

// dinp: (N) +=, inp: (N), dout: (N).
extern "C" __global__ void gelu_backward_f32(float *__restrict__ dinp, const float *__restrict__ inp,
                                             const float *__restrict__ dout, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float x = inp[i];
        const float cube = GELU_CUBE * x * x * x;
        const float tanh_out = tanh_exp(GELU_SCALE * (x + cube));
        const float sech2 = 1.0f - tanh_out * tanh_out;
        const float local =
            0.5f * (1.0f + tanh_out) + x * 0.5f * sech2 * GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
        dinp[i] += local * dout[i];
    }
}
