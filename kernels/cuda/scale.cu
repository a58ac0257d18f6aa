// Elementwise kernels: scale a gradient slice in place, x[i] *= s (the clip-and-average
// coefficient; one IEEE f32 multiply, compiled with --fmad=false: bitwise the CPU's `scale`), and
// the backend's fill and 2D copy.

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

// x[i] = value.
extern "C" __global__ void fill_f32(float *__restrict__ x, u64 n, float value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = value;
}

// height rows of width elements: dst[r * dst_pitch + j] = src[r * src_pitch + j].
extern "C" __global__ void copy_2d_f32(float *__restrict__ dst, u64 dst_pitch, const float *__restrict__ src,
                                       u64 src_pitch, u64 width, u64 height) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < width * height; e += (u64)gridDim.x * blockDim.x)
        dst[e / width * dst_pitch + e % width] = src[e / width * src_pitch + e % width];
}
