// The fused health scan on the GPU: one read of a gradient slice gives its NaN count, Inf count,
// the f64 sum of squares of its FINITE elements and the index of its first non-finite element.
//
// One launch, no float atomics, so the result is bitwise repeatable run after run and independent
// of the GPU model (the partition depends on n only):
//   block b scans tile b (HEALTH_TILE elements in rounds of 16-byte loads, every load of a round
//   issued before any is used), folds its threads' rows in a fixed-shape tree in shared memory and
//   writes one partial row; the block that finishes last (an integer ticket, `atomicAdd` on a
//   counter) folds the partial rows in tile order with the same tree, writes the result row and
//   resets the counter for the next launch.
// A row is 4 words: [nan, inf, sum of squares (f64 bits), first bad index (~0 = none)].
// The square of an f32 is exact in f64 (24-bit mantissa), so `fma(f, f, s)` is `s + f * f` to the
// bit and only the order of the additions differs from the CPU scan: counts and first index are
// equal, the sums differ by at most 2 (n - 1) 2^-53 of the sum (the test's bound).
// No warp shuffles: the tree runs through shared memory (the CPU shim can execute it).
//
// `read_only_<dtype>` is the baseline of the scan's bandwidth: the same tiles and loads, with only
// an xor of the bits per element and one word written per block.

#define HEALTH_THREADS 256
#define HEALTH_LOADS 8    // 16-byte loads per thread per round
#define HEALTH_ROUNDS 4   // rounds per tile (f32; 2 for bf16)
#define HEALTH_TILE (HEALTH_THREADS * HEALTH_LOADS * HEALTH_ROUNDS * 4)  // 32768 elements
#define NO_BAD 0xffffffffffffffffULL

typedef unsigned long long u64;

struct Row {
    u64 nan;
    u64 inf;
    double ss;
    u64 first;
};

// One thread's tallies (at most HEALTH_TILE / HEALTH_THREADS = 128 elements: 32-bit counts).
struct Acc {
    unsigned nan;
    unsigned bad;
    double ss;
    u64 first;
};

__device__ __forceinline__ void take(Acc &a, float v, u64 i) {
    const unsigned b = __float_as_uint(v) & 0x7fffffffu;
    const bool bad = b >= 0x7f800000u;  // +-Inf or NaN
    a.nan += b > 0x7f800000u;
    a.bad += bad;
    const double f = bad ? 0.0 : (double)v;
    a.ss = fma(f, f, a.ss);  // the product is exact: the same bits as a.ss + f * f
    if (bad && i < a.first) a.first = i;
}

__device__ __forceinline__ void fold(Row &a, const Row &b) {
    a.nan += b.nan;
    a.inf += b.inf;
    a.ss += b.ss;
    a.first = b.first < a.first ? b.first : a.first;
}

// Fixed-shape tree of HEALTH_THREADS rows in shared memory; every thread calls it; thread 0 gets
// the result.
__device__ Row block_fold(Row r) {
    __shared__ Row rows[HEALTH_THREADS];
    const unsigned t = threadIdx.x;
    rows[t] = r;
    __syncthreads();
    for (unsigned s = HEALTH_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) fold(rows[t], rows[t + s]);
        __syncthreads();
    }
    return rows[0];
}

__device__ __forceinline__ void store(u64 *out, const Row &r) {
    out[0] = r.nan;
    out[1] = r.inf;
    out[2] = (u64)__double_as_longlong(r.ss);
    out[3] = r.first;
}

// After block b's partial row is in `part`: the last block to finish folds every partial row, in
// tile order, into `out`, and resets the counter.
__device__ void finish(const Row &mine, u64 *part, unsigned *counter, u64 *out) {
    __shared__ unsigned last;
    if (threadIdx.x == 0) {
        store(part + 4 * (u64)blockIdx.x, mine);
        __threadfence();  // the row is visible to every block before the ticket is taken
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;  // the same value for every thread of the block: the barriers below agree
    __threadfence();
    Row r = {0, 0, 0.0, NO_BAD};
    for (u64 j = threadIdx.x; j < gridDim.x; j += HEALTH_THREADS) {
        const volatile u64 *p = part + 4 * j;  // written by other blocks: past this SM's L1
        const Row o = {p[0], p[1], __longlong_as_double((long long)p[2]), p[3]};
        fold(r, o);
    }
    r = block_fold(r);
    if (threadIdx.x == 0) {
        store(out, r);
        *counter = 0;
    }
}

__device__ __forceinline__ Row to_row(const Acc &a) {
    const Row r = {a.nan, (u64)(a.bad - a.nan), a.ss, a.first};
    return r;
}

// bf16 words are the high halves of f32: widening is exact. A 32-bit word holds elements 2j (low
// half) and 2j + 1 (high half).
__device__ __forceinline__ float lo_bf16(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// x: (n) f32; part: (4 * gridDim.x) words; counter: one word, 0 between launches; out: 4 words.
// gridDim.x = ceil(n / HEALTH_TILE).
extern "C" __global__ void __launch_bounds__(HEALTH_THREADS)
health_scan_f32(const float *__restrict__ x, u64 n, u64 *__restrict__ part, unsigned *counter, u64 *out) {
    const u64 base = (u64)blockIdx.x * HEALTH_TILE;
    const unsigned t = threadIdx.x;
    Acc a = {0, 0, 0.0, NO_BAD};
    if (base + HEALTH_TILE <= n && ((u64)x & 15) == 0) {
        const float4 *v4 = (const float4 *)(x + base);
        for (int round = 0; round < HEALTH_ROUNDS; round++) {
            float4 v[HEALTH_LOADS];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++) v[k] = v4[(round * HEALTH_LOADS + k) * HEALTH_THREADS + t];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++) {
                const u64 i = base + 4 * (u64)((round * HEALTH_LOADS + k) * HEALTH_THREADS + t);
                take(a, v[k].x, i);
                take(a, v[k].y, i + 1);
                take(a, v[k].z, i + 2);
                take(a, v[k].w, i + 3);
            }
        }
    } else {
        for (u64 i = base + t; i < base + HEALTH_TILE && i < n; i += HEALTH_THREADS) take(a, x[i], i);
    }
    finish(block_fold(to_row(a)), part, counter, out);
}

// x: (n) bf16 words; as health_scan_f32.
extern "C" __global__ void __launch_bounds__(HEALTH_THREADS)
health_scan_bf16(const unsigned short *__restrict__ x, u64 n, u64 *__restrict__ part, unsigned *counter,
                 u64 *out) {
    const u64 base = (u64)blockIdx.x * HEALTH_TILE;
    const unsigned t = threadIdx.x;
    Acc a = {0, 0, 0.0, NO_BAD};
    if (base + HEALTH_TILE <= n && ((u64)x & 15) == 0) {
        const uint4 *v4 = (const uint4 *)(x + base);
        for (int round = 0; round < HEALTH_ROUNDS / 2; round++) {
            uint4 v[HEALTH_LOADS];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++) v[k] = v4[(round * HEALTH_LOADS + k) * HEALTH_THREADS + t];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++) {
                const u64 i = base + 8 * (u64)((round * HEALTH_LOADS + k) * HEALTH_THREADS + t);
                const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
                for (int q = 0; q < 4; q++) {
                    take(a, lo_bf16(w[q]), i + 2 * q);
                    take(a, hi_bf16(w[q]), i + 2 * q + 1);
                }
            }
        }
    } else {
        for (u64 i = base + t; i < base + HEALTH_TILE && i < n; i += HEALTH_THREADS)
            take(a, __uint_as_float(((unsigned)x[i]) << 16), i);
    }
    finish(block_fold(to_row(a)), part, counter, out);
}

// The baseline: health_scan_f32's tiles and loads, an xor per element, one word per block.
// part: (gridDim.x) words.
extern "C" __global__ void __launch_bounds__(HEALTH_THREADS)
read_only_f32(const float *__restrict__ x, u64 n, unsigned *__restrict__ part) {
    const u64 base = (u64)blockIdx.x * HEALTH_TILE;
    const unsigned t = threadIdx.x;
    unsigned acc = 0;
    if (base + HEALTH_TILE <= n && ((u64)x & 15) == 0) {
        const float4 *v4 = (const float4 *)(x + base);
        for (int round = 0; round < HEALTH_ROUNDS; round++) {
            float4 v[HEALTH_LOADS];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++) v[k] = v4[(round * HEALTH_LOADS + k) * HEALTH_THREADS + t];
#pragma unroll
            for (int k = 0; k < HEALTH_LOADS; k++)
                acc ^= __float_as_uint(v[k].x) ^ __float_as_uint(v[k].y) ^ __float_as_uint(v[k].z) ^
                       __float_as_uint(v[k].w);
        }
    } else {
        for (u64 i = base + t; i < base + HEALTH_TILE && i < n; i += HEALTH_THREADS) acc ^= __float_as_uint(x[i]);
    }
    __shared__ unsigned words[HEALTH_THREADS];
    words[t] = acc;
    __syncthreads();
    for (unsigned s = HEALTH_THREADS / 2; s > 0; s >>= 1) {  // block_fold's tree
        if (t < s) words[t] ^= words[t + s];
        __syncthreads();
    }
    if (t == 0) part[blockIdx.x] = words[0];
}
