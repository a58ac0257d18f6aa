// cuda_shim.h: runs the CUDA kernels of kernels/cuda/*.cu on the CPU, for the tests that compare
// every kernel with its CPU twin on a machine without a GPU (kernels/tests/shim/mod.rs builds each
// .cu file with `g++ -include cuda_shim.h` into its own shared library and calls `shim_launch`).
//
// What it emulates, exactly:
// - the launch: every block of the grid, one block at a time (in index order, or in reverse order),
//   and every thread of a block as a fiber (ucontext) on one OS thread;
// - `threadIdx`, `blockIdx`, `blockDim`, `gridDim` (per fiber), `__shared__` (one copy, which is
//   per block because blocks run one at a time), `float4` and `uint4` loads;
// - `__syncthreads()`: the fiber stops at the barrier; when EVERY live thread of the block has
//   reached it, all continue. A block in which some threads end while others wait at a barrier is
//   an error (`shim_launch` returns 1), as the CUDA programming guide makes it undefined behaviour;
// - between barriers each thread runs alone, in thread order (or in reverse thread order): a kernel
//   whose result depends on that order (a missing barrier, a race on shared or global memory
//   between threads or blocks) gives different results under the two orders, which the tests
//   compare bitwise;
// - `atomicAdd` on unsigned int and `__threadfence()` (one fiber runs at a time: a plain add is
//   atomic, every write is visible);
// - the bit casts (`__float_as_uint`, ...) and the math functions, as the host's <math.h>.
//
// What it does NOT emulate, and the tests therefore do not cover:
// - warp-level operations (`__shfl_*_sync`, `__ballot_sync`, `__syncwarp`, ...): not defined here,
//   so a kernel that uses one does not compile against the shim. The kernels use none;
// - the CUDA math library's rounding: `expf`, `logf` (and everything built on them) are glibc's
//   here - the same functions the Rust CPU kernels call, so the shim compares the kernels' ORDER of
//   operations with the CPU's bit for bit, and the GPU tests (kernels/tests/cuda.rs) carry the
//   tolerances of CUDA's own `expf` (2 ulp) and `logf` (1 ulp). What it offers instead: built with
//   `-DSHIM_LIBM_ULPS=K` (and `-DSHIM_LIBM_SPREAD` or not), `expf` and `logf` return glibc's result
//   moved by K ulps (up, or down for K < 0; with SPREAD by -K..K ulps, a hash of the argument's bits
//   choosing: the same for both schedules), never past 0, an infinity or a change of sign, and
//   exp(0) = 1 kept: a math library K ulps from glibc's, which the tests' tolerances must admit at
//   |K| = 3 (CUDA's 2 ulp + glibc's 1) and refuse far out;
// - the memory model between blocks (fences, caches): blocks run one after another;
// - dynamic shared memory (`extern __shared__`), textures, streams, cooperative groups.
//
// Build: g++ -std=c++17 -O1 -fPIC -shared -ffp-contract=off -include cuda_shim.h -x c++ file.cu.
// -ffp-contract=off and no -march: no fused multiply-add unless a kernel calls fma()/fmaf(), as
// NVRTC's --fmad=false; SSE arithmetic is IEEE single/double with denormals (no FTZ/DAZ).
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

struct dim3 {
    unsigned x, y, z;
};
typedef dim3 uint3;
// The vector types the kernels load with (16-byte loads on the GPU).
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};

// Everything the shim defines has internal linkage except `shim_launch`, so
// each .cu file's library keeps its own copy and no helper of one file can replace another's.
#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline long long __double_as_longlong(double d) {
    long long u;
    memcpy(&u, &d, 8);
    return u;
}
static inline double __longlong_as_double(long long u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
static inline void __threadfence() {}

#ifdef SHIM_LIBM_ULPS
// A math library SHIM_LIBM_ULPS ulps from glibc's (see the top; the harness inlines libm_nudge.h).
#include "libm_nudge.h"
#ifdef SHIM_LIBM_SPREAD
#define SHIM_SPREAD 1
#else
#define SHIM_SPREAD 0
#endif
// exp(0) = 1 is exact in every math library (as log(1) = 0, which the nudge leaves as a 0).
static inline float shim_expf(float x) { return x == 0.0f ? 1.0f : libm_nudge(x, expf(x), SHIM_LIBM_ULPS, SHIM_SPREAD); }
static inline float shim_logf(float x) { return libm_nudge(x, logf(x), SHIM_LIBM_ULPS, SHIM_SPREAD); }
#define expf shim_expf
#define logf shim_logf
#endif

namespace shim {

enum State { RUNNABLE, AT_BARRIER, DONE };

struct Fiber {
    ucontext_t ctx;
    State state;
    uint3 tid;
};

// Enough for the kernels' locals (the largest is a few hundred bytes) and the Rust closure that
// calls the kernel.
static const size_t STACK = 256 * 1024;

static ucontext_t sched;
static Fiber *fibers;
static char *stacks;
static unsigned nfibers_cap;
static Fiber *cur;
static void (*body)(void *);
static void *body_arg;
static int order;

static void entry() {
    body(body_arg);
    cur->state = DONE;
    // uc_link returns to the scheduler.
}

static void sync() {
    cur->state = AT_BARRIER;
    swapcontext(&cur->ctx, &sched);
}

// Run one block to completion; 0 on success, 1 on a barrier that not every thread reached.
static int run_block(unsigned n) {
    for (unsigned i = 0; i < n; i++) {
        Fiber &f = fibers[i];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks + (size_t)i * STACK;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &sched;
        makecontext(&f.ctx, entry, 0);
        f.state = RUNNABLE;
        f.tid.x = i % blockDim.x;
        f.tid.y = i / blockDim.x % blockDim.y;
        f.tid.z = i / (blockDim.x * blockDim.y);
    }
    for (;;) {
        for (unsigned k = 0; k < n; k++) {
            Fiber &f = fibers[order ? n - 1 - k : k];
            if (f.state != RUNNABLE) continue;
            cur = &f;
            threadIdx = f.tid;
            swapcontext(&sched, &f.ctx);
        }
        unsigned done = 0, waiting = 0;
        for (unsigned i = 0; i < n; i++) {
            done += fibers[i].state == DONE;
            waiting += fibers[i].state == AT_BARRIER;
        }
        if (done == n) return 0;
        if (done != 0) {
            fprintf(stderr, "cuda_shim: block (%u,%u,%u): %u threads ended while %u wait at __syncthreads\n",
                    blockIdx.x, blockIdx.y, blockIdx.z, done, waiting);
            return 1;
        }
        for (unsigned i = 0; i < n; i++) fibers[i].state = RUNNABLE;
    }
}

}  // namespace shim

#define __syncthreads() shim::sync()

// Launch `kernel_call(arg)` (a closure that calls one kernel with its arguments) on a grid of
// `grid` blocks of `block` threads, blocks and threads in index order (`reverse` 0) or in reverse
// order (1). Returns 0, or 1 after a message on stderr. Not reentrant: the caller serializes.
extern "C" int shim_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           int reverse, void (*kernel_call)(void *), void *arg) {
    using namespace shim;
    order = reverse;
    const unsigned n = bx * by * bz;
    if (n == 0 || n > 1024 || gx == 0 || gy == 0 || gz == 0) {
        fprintf(stderr, "cuda_shim: bad launch (%u,%u,%u) x (%u,%u,%u)\n", gx, gy, gz, bx, by, bz);
        return 1;
    }
    if (n > nfibers_cap) {
        free(fibers);
        free(stacks);
        fibers = (Fiber *)calloc(n, sizeof(Fiber));
        stacks = (char *)malloc((size_t)n * STACK);
        if (!fibers || !stacks) {
            fprintf(stderr, "cuda_shim: out of memory for %u fibers\n", n);
            return 1;
        }
        nfibers_cap = n;
    }
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, by, bz};
    body = kernel_call;
    body_arg = arg;
    const unsigned long long blocks = (unsigned long long)gx * gy * gz;
    for (unsigned long long k = 0; k < blocks; k++) {
        const unsigned long long b = order ? blocks - 1 - k : k;
        blockIdx = uint3{(unsigned)(b % gx), (unsigned)(b / gx % gy), (unsigned)(b / ((unsigned long long)gx * gy))};
        if (run_block(n)) return 1;
    }
    return 0;
}
