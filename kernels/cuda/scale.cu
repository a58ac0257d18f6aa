// Scale a gradient slice in place: x[i] *= s (the clip-and-average coefficient), elementwise, so
// the result is bitwise the CPU's `scale` (one IEEE f32 multiply; compiled with --fmad=false).

typedef unsigned long long u64;

extern "C" __global__ void scale_f32(float *__restrict__ x, u64 n, float s) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] *= s;
}

// bf16 stored as raw 16-bit words: widen exactly, multiply in f32, round to nearest even (a NaN
// stays a quiet NaN, an overflow becomes Inf, as a cast to bf16 does).
__device__ __forceinline__ unsigned short to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    if (f != f) return (unsigned short)((u >> 16) | 0x40);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void scale_bf16(unsigned short *__restrict__ x, u64 n, float s) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = to_bf16(__uint_as_float(((unsigned)x[i]) << 16) * s);
}
