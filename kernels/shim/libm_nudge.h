// libm_nudge.h: a math library K ulps from the host's, for the measurements behind the GPU check's
// tolerances (docs/gpu.md). CUDA's expf is within 2 ulp and logf within 1 ulp of the exact value,
// glibc's within 1: the two differ by at most 3 ulps. Used twice:
// - cuda_shim.h with -DSHIM_LIBM_ULPS=K (kernels/tests/cuda_shim.rs): the kernels' expf/logf, K fixed
//   at build time (the tolerances of kernels/tests/cuda_twins/mod.rs);
// - libm_nudge.c, an LD_PRELOAD library over glibc's expf/logf with K from the environment: a whole
//   gradbus run on the CPU with another correct math library (how far two correct machines' losses
//   part: scripts/gpu-check.d/common.sh, compare_runs).
#pragma once
#include <math.h>
#include <string.h>

// y = f(x) moved by k ulps (up for k > 0, down for k < 0; with `spread`, by -|k|..|k|, a hash of x's
// bits choosing, so the same argument always gets the same result), never past 0, an infinity or a
// change of sign; 0, NaN and Inf unchanged.
static inline float libm_nudge(float x, float y, int k, int spread) {
    if (!isfinite(y) || y == 0.0f) return y;
    if (spread) {
        unsigned h;
        memcpy(&h, &x, 4);
        h ^= h >> 16;
        h *= 0x7feb352du;
        h ^= h >> 15;
        const unsigned m = 2u * (unsigned)(k < 0 ? -k : k) + 1;
        k = (int)(h % m) - (k < 0 ? -k : k);
    }
    for (; k != 0; k += k > 0 ? -1 : 1) {
        const float z = nextafterf(y, k > 0 ? INFINITY : -INFINITY);
        if (!isfinite(z) || (y > 0) != (z > 0) || z == 0.0f) break;
        y = z;
    }
    return y;
}
