// The fused health scan on the GPU: one read of a gradient slice gives its NaN count, Inf count,
// the f64 sum of squares of its FINITE elements and the index of its first non-finite element.
//
// Two passes, no atomics, so the result is bitwise repeatable run after run (and independent of the
// GPU model: the partition depends on n only):
//   pass 1  health_partial_<dtype>: block b scans tile b (HEALTH_TILE elements: thread t takes
//           elements t, t + 256, ... of the tile, in order), then a fixed-shape block reduction
//           (warp shuffles, then warps 0..7 in order) writes one partial row for the tile;
//   pass 2  health_final: one block folds the partial rows - thread t takes rows t, t + 1024, ...
//           in order, then the same fixed-shape reduction - into one row.
// A row is 4 words: [nan, inf, sum of squares (f64 bits), first bad index (~0 = none)].
// The square of an f32 is exact in f64 (24-bit mantissa), so only the order of the additions
// differs from the CPU scan: counts and first index are equal, sums agree to ~1e-15 relative.

#define HEALTH_THREADS 256
#define HEALTH_PER_THREAD 32
#define HEALTH_TILE (HEALTH_THREADS * HEALTH_PER_THREAD)
#define FINAL_THREADS 1024
#define NO_BAD 0xffffffffffffffffULL

typedef unsigned long long u64;

struct Row {
    u64 nan;
    u64 inf;
    double ss;
    u64 first;
};

__device__ __forceinline__ void fold(Row &a, const Row &b) {
    a.nan += b.nan;
    a.inf += b.inf;
    a.ss += b.ss;
    a.first = b.first < a.first ? b.first : a.first;
}

// Fixed-shape reduction of one row per thread into thread 0's row (blockDim.x a multiple of 32,
// at most 1024). Every thread must call it.
__device__ Row block_fold(Row r) {
    __shared__ Row warps[32];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int d = 16; d > 0; d >>= 1) {
        Row o;
        o.nan = __shfl_down_sync(0xffffffffu, r.nan, d);
        o.inf = __shfl_down_sync(0xffffffffu, r.inf, d);
        o.ss = __shfl_down_sync(0xffffffffu, r.ss, d);
        o.first = __shfl_down_sync(0xffffffffu, r.first, d);
        fold(r, o);
    }
    if (lane == 0) warps[warp] = r;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; w++) fold(r, warps[w]);
    }
    return r;
}

__device__ __forceinline__ void take(Row &r, float v, u64 i) {
    const bool nan = v != v;
    const bool finite = fabsf(v) <= 3.402823466e38f;  // false for +-Inf and NaN
    r.nan += nan;
    r.inf += !finite && !nan;
    const double f = finite ? (double)v : 0.0;
    r.ss += f * f;
    if (!finite && r.first == NO_BAD) r.first = i;
}

__device__ __forceinline__ void store(u64 *out, const Row &r) {
    out[0] = r.nan;
    out[1] = r.inf;
    out[2] = (u64)__double_as_longlong(r.ss);
    out[3] = r.first;
}

// Loads of a full tile are issued before any is used (HEALTH_PER_THREAD loads in flight per
// thread), which is what keeps the scan at the copy's bandwidth.
#define HEALTH_PARTIAL(NAME, T, WIDEN)                                                        \
    extern "C" __global__ void __launch_bounds__(HEALTH_THREADS)                              \
    NAME(const T *__restrict__ x, u64 n, u64 *__restrict__ part) {                            \
        const u64 base = (u64)blockIdx.x * HEALTH_TILE;                                       \
        Row r = {0, 0, 0.0, NO_BAD};                                                          \
        if (base + HEALTH_TILE <= n) {                                                        \
            T v[HEALTH_PER_THREAD];                                                           \
            _Pragma("unroll") for (int k = 0; k < HEALTH_PER_THREAD; k++)                     \
                v[k] = x[base + k * HEALTH_THREADS + threadIdx.x];                            \
            _Pragma("unroll") for (int k = 0; k < HEALTH_PER_THREAD; k++)                     \
                take(r, WIDEN(v[k]), base + k * HEALTH_THREADS + threadIdx.x);                \
        } else {                                                                              \
            for (int k = 0; k < HEALTH_PER_THREAD; k++) {                                     \
                const u64 i = base + k * HEALTH_THREADS + threadIdx.x;                        \
                if (i < n) take(r, WIDEN(x[i]), i);                                           \
            }                                                                                 \
        }                                                                                     \
        r = block_fold(r);                                                                    \
        if (threadIdx.x == 0) store(part + 4 * (u64)blockIdx.x, r);                           \
    }

__device__ __forceinline__ float widen_f32(float v) { return v; }
// bf16 is the high half of an f32: widening is exact.
__device__ __forceinline__ float widen_bf16(unsigned short v) {
    return __uint_as_float(((unsigned)v) << 16);
}

HEALTH_PARTIAL(health_partial_f32, float, widen_f32)
HEALTH_PARTIAL(health_partial_bf16, unsigned short, widen_bf16)

// Pass 2: fold `tiles` partial rows (in tile order; the first bad index is already absolute).
extern "C" __global__ void __launch_bounds__(FINAL_THREADS)
health_final(const u64 *__restrict__ part, u64 tiles, u64 *__restrict__ out) {
    Row r = {0, 0, 0.0, NO_BAD};
    for (u64 j = threadIdx.x; j < tiles; j += FINAL_THREADS) {
        const u64 *p = part + 4 * j;
        Row o = {p[0], p[1], __longlong_as_double((long long)p[2]), p[3]};
        fold(r, o);
    }
    r = block_fold(r);
    if (threadIdx.x == 0) store(out, r);
}
