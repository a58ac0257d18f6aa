// AdamW on flat f32 slices, one thread per element, the CPU kernel's arithmetic operation for
// operation (see kernels/src/ops/adamw.rs): the host computes the same scalars the CPU kernel does
// (`AdamwScalars`), and with --fmad=false, IEEE division and square root and no flush-to-zero every
// element gets the CPU's bits.

typedef unsigned long long u64;

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
