// AdamW on flat f32 slices, one thread per element, the CPU kernel's arithmetic operation for
// operation (see kernels/src/ops/adamw.rs): the host computes the same scalars the CPU kernel does
// (`AdamwScalars`), and with --fmad=false, IEEE division and square root and no flush-to-zero every
// element gets the CPU's bits.
//
// The replica checksum (kernels/src/checksum.rs) of the updated parameters: word i goes to lane
// i % 128 of 128 FNV-1a lanes, `lane = (lane ^ word) * FNV_PRIME`, in order. Each lane is one
// sequential chain (no parallel form), so `checksum_lanes_f32` runs one thread per lane; the host
// folds the 128 lanes with `checksum::fold`, the CPU's own code.

typedef unsigned long long u64;

#define CHECKSUM_LANES 128
#define FNV_PRIME 0x01000193u
#define FNV_OFFSET 0x811c9dc5u

extern "C" __global__ void adamw_update_f32(float *__restrict__ params, const float *__restrict__ grads,
                                            float *__restrict__ m, float *__restrict__ v, u64 n,
                                            float one_minus_beta1, float beta2, float one_minus_beta2,
                                            float eps, float decay, float step_size, float bc2_sqrt) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float g = grads[i];
        float mi = m[i], vi = v[i], p = params[i];
        mi += (g - mi) * one_minus_beta1;
        vi = vi * beta2 + one_minus_beta2 * g * g;
        p *= decay;
        p -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
        m[i] = mi;
        v[i] = vi;
        params[i] = p;
    }
}

// x: (n); lanes: (128). One block of CHECKSUM_LANES threads; the loads of a lane run ahead of its
// chain (they do not depend on it).
extern "C" __global__ void __launch_bounds__(CHECKSUM_LANES)
checksum_lanes_f32(const float *__restrict__ x, u64 n, unsigned *__restrict__ lanes) {
    const unsigned l = threadIdx.x;
    unsigned h = FNV_OFFSET ^ l;
    u64 i = l;
    for (; i + 7 * CHECKSUM_LANES < n; i += 8 * CHECKSUM_LANES) {
        unsigned w[8];
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = __float_as_uint(x[i + k * CHECKSUM_LANES]);
#pragma unroll
        for (int k = 0; k < 8; k++) h = (h ^ w[k]) * FNV_PRIME;
    }
    for (; i < n; i += CHECKSUM_LANES) h = (h ^ __float_as_uint(x[i])) * FNV_PRIME;
    lanes[l] = h;
}
