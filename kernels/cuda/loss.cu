// The GRPO loss's per-position part (kernels/src/ops/grpo.rs) in both styles, operation for
// operation:
//   roll: both exps at EVERY position, no clamp of the log-ratio, k3 clamped after its exp, the
//         mask multiplied in afterwards - an exp that overflows gives a finite loss and a NaN
//         gradient, also at masked positions;
//   safe: masked positions selected out first, log-ratios clamped to [-lim, lim] before the exps.
// NaN follows PyTorch: `torch_min` is NaN if either side is, `clampf` keeps NaN, a clamp's
// gradient is 0 outside [lo, hi] and for NaN. A position not evaluated (masked, safe style) holds
// ratio = e2 = 1 and 0 elsewhere, as on the CPU.
//
// Three launches: per position (grpo_forward_f32, elementwise: the saved values and the terms),
// the token means and the stats (grpo_reduce_f32, ONE thread: the CPU's sums in the CPU's order,
// each term recomputed from the saved values with the forward's operations), and the backward per
// position (grpo_backward_f32). Bitwise the CPU's up to expf.
//
// The stats (`stats`, LOSS_STATS floats), in this order: loss, ratio, kl,
// max_ratio_logratio_response, max_ratio_logratio_masked, max_kl_logratio_response,
// max_kl_logratio_masked, max_logratio_response, max_logratio_masked, min_response_logp,
// response_tokens, denom.

typedef unsigned long long u64;

__device__ __forceinline__ float clampf(float x, float lo, float hi) {  // Rust's f32::clamp: NaN stays
    float r = x;
    if (r < lo) r = lo;
    if (r > hi) r = hi;
    return r;
}

__device__ __forceinline__ float torch_min(float a, float b) {
    return (a != a || b != b) ? __uint_as_float(0x7fc00000u) : fminf(a, b);
}

__device__ __forceinline__ float clamp_grad(float g, float x, float lo, float hi) {
    return (x >= lo && x <= hi) ? g : 0.0f;
}

// The policy-gradient term -min(r a, clamp(r, lo, hi) a).
__device__ __forceinline__ float pg_term(float r, float a, float lo, float hi) {
    return -torch_min(r * a, clampf(r, lo, hi) * a);
}

// Per position i < n = B T (t = T; sequence i / t). safe: 0 (roll) or 1; lim: the log-ratio
// clamp (safe) or +inf (roll); lo, hi: 1 -+ clip; k3_clamp: the bound of k3.
extern "C" __global__ void grpo_forward_f32(const float *__restrict__ logp, const float *__restrict__ mask,
                                            const float *__restrict__ adv, const float *__restrict__ old,
                                            const float *__restrict__ reference, u64 n, u64 t, int safe,
                                            float lim, float lo, float hi, float k3_clamp, float kl_coef,
                                            float *__restrict__ lr1_raw, float *__restrict__ lr1,
                                            float *__restrict__ ratio, float *__restrict__ lr2_raw,
                                            float *__restrict__ lr2, float *__restrict__ e2, float *__restrict__ k3,
                                            float *__restrict__ terms) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        lr1_raw[i] = logp[i] - old[i];
        lr2_raw[i] = reference[i] - logp[i];
        if (safe && mask[i] == 0.0f) {  // selected out: no exp, no term, no gradient
            lr1[i] = 0.0f;
            ratio[i] = 1.0f;
            lr2[i] = 0.0f;
            e2[i] = 1.0f;
            k3[i] = 0.0f;
            terms[i] = 0.0f;
            continue;
        }
        const float l1 = clampf(lr1_raw[i], -lim, lim), r = expf(l1);
        const float l2 = clampf(lr2_raw[i], -lim, lim), e = expf(l2);
        const float k = (e - 1.0f) - l2;
        lr1[i] = l1;
        ratio[i] = r;
        lr2[i] = l2;
        e2[i] = e;
        k3[i] = k;
        const float pg = pg_term(r, adv[i / t], lo, hi);
        const float kc = clampf(k, -k3_clamp, k3_clamp);
        const float m = safe ? 1.0f : mask[i];
        terms[i] = pg * m + kl_coef * kc * m;
    }
}

// The token means and the stats, in one thread (grid 1 x 1): the CPU's loops in the CPU's order.
extern "C" __global__ void grpo_reduce_f32(const float *__restrict__ logp, const float *__restrict__ mask,
                                           const float *__restrict__ adv, const float *__restrict__ lr1_raw,
                                           const float *__restrict__ lr2_raw, const float *__restrict__ ratio,
                                           const float *__restrict__ k3, u64 n, u64 t, int safe, float lo, float hi,
                                           float k3_clamp, float kl_coef, float *__restrict__ stats) {
    float m1r = 0.0f, m1m = 0.0f, m2r = 0.0f, m2m = 0.0f;
    float min_logp = __uint_as_float(0x7f800000u);  // +inf
    u64 count = 0;
    for (u64 i = 0; i < n; i++) {
        const bool resp = mask[i] != 0.0f;
        count += resp;
        if (resp) {
            m1r = fmaxf(m1r, fabsf(lr1_raw[i]));
            m2r = fmaxf(m2r, fabsf(lr2_raw[i]));
            min_logp = fminf(min_logp, logp[i]);
        } else {
            m1m = fmaxf(m1m, fabsf(lr1_raw[i]));
            m2m = fmaxf(m2m, fabsf(lr2_raw[i]));
        }
    }
    const float denom = (float)(count > 0 ? count : 1);
    float pg_sum = 0.0f, kl_sum = 0.0f, ratio_sum = 0.0f, kl_resp_sum = 0.0f;
    for (u64 i = 0; i < n; i++) {
        if (safe && mask[i] == 0.0f) continue;
        const float pg = pg_term(ratio[i], adv[i / t], lo, hi);
        const float kc = clampf(k3[i], -k3_clamp, k3_clamp);
        const float m = safe ? 1.0f : mask[i];
        pg_sum += pg * m;
        kl_sum += kc * m;
        if (mask[i] != 0.0f) {
            ratio_sum += ratio[i];
            kl_resp_sum += kc;
        }
    }
    stats[0] = pg_sum / denom + kl_coef * (kl_sum / denom);
    stats[1] = ratio_sum / denom;
    stats[2] = kl_resp_sum / denom;
    stats[3] = m1r;
    stats[4] = m1m;
    stats[5] = m2r;
    stats[6] = m2m;
    stats[7] = fmaxf(m1r, m2r);
    stats[8] = fmaxf(m1m, m2m);
    stats[9] = count > 0 ? min_logp : 0.0f;
    stats[10] = (float)count;
    stats[11] = denom;
}

// Backward per position: d_lr1 (the ratio exp's input gradient), d_lr2 (the k3 exp's) and dlogp,
// replaying PyTorch autograd's arithmetic for the graph grpo_forward_f32 built; 0 where not
// evaluated. denom: the forward's token-mean divisor.
extern "C" __global__ void grpo_backward_f32(const float *__restrict__ mask, const float *__restrict__ adv, u64 n,
                                             u64 t, int safe, float lim, float lo, float hi, float k3_clamp,
                                             float kl_coef, float denom, const float *__restrict__ lr1_raw,
                                             const float *__restrict__ lr2_raw, const float *__restrict__ ratio,
                                             const float *__restrict__ e2, const float *__restrict__ k3,
                                             float *__restrict__ d_lr1, float *__restrict__ d_lr2,
                                             float *__restrict__ dlogp) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (safe && mask[i] == 0.0f) {
            d_lr1[i] = 0.0f;
            d_lr2[i] = 0.0f;
            dlogp[i] = 0.0f;
            continue;
        }
        const float a = adv[i / t];
        const float m = safe ? 1.0f : mask[i];
        const float d_pg = (1.0f / denom) * m;
        const float d_k3c = (kl_coef / denom) * m;
        const float d_min = -d_pg;  // pg = -min(surr1, surr2); min's backward splits ties
        const float r = ratio[i];
        const float surr1 = r * a, surr2 = clampf(r, lo, hi) * a;
        const float half = surr1 == surr2 ? d_min / 2.0f : d_min;
        const float d_surr1 = surr1 > surr2 ? 0.0f : half;
        const float d_surr2 = surr1 < surr2 ? 0.0f : half;
        const float d_ratio = d_surr1 * a + clamp_grad(d_surr2 * a, r, lo, hi);
        const float g_lr1 = d_ratio * r;  // ratio = exp(lr1): the gradient times the output
        const float d_k3 = clamp_grad(d_k3c, k3[i], -k3_clamp, k3_clamp);
        const float g_lr2 = d_k3 * e2[i] + -d_k3;  // k3 = (e2 - 1) - lr2, e2 = exp(lr2)
        d_lr1[i] = g_lr1;
        d_lr2[i] = g_lr2;
        const float g1 = safe ? clamp_grad(g_lr1, lr1_raw[i], -lim, lim) : g_lr1;
        const float g2 = safe ? clamp_grad(g_lr2, lr2_raw[i], -lim, lim) : g_lr2;
        dlogp[i] = g1 + -g2;
    }
}
