// The GRPO loss (worker/src/loss.rs) in both styles, operation for operation:
//   roll: both exps at EVERY position, no clamp of the log-ratio, k3 clamped after its exp, the
//         mask multiplied in afterwards - an exp that overflows gives a finite loss and a NaN
//         gradient, also at masked positions;
//   safe: masked positions selected out first, log-ratios clamped to [-lim, lim] before the exps.
// NaN follows PyTorch: `torch_min` is NaN if either side is, `clampf` keeps NaN, a clamp's
// gradient is 0 outside [lo, hi] and for NaN.
//
// Three launches after log-softmax-gather: per position (loss_forward_f32, elementwise), the token
// means and the stats (loss_reduce_f32, ONE thread: the CPU's sums in the CPU's order), and the
// backward per position (loss_backward_f32), which reads the mean's divisor from the stats on the
// device. Bitwise the CPU's up to expf.
//
// The stats (`stats`, floats), in this order: loss, ratio, kl, max_ratio_logratio_response,
// max_ratio_logratio_masked, max_kl_logratio_response, max_kl_logratio_masked,
// max_logratio_response, max_logratio_masked, min_response_logp, response_tokens, denom.

typedef unsigned long long u64;

#define STATS 12

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

// Per position i < n = B T (t = T; sequence i / t): the cached values and the terms.
// safe: 0 (roll) or 1; lim: the log-ratio clamp (safe) or +inf (roll); lo, hi: 1 -+ clip; k3_clamp:
// the bound of k3.
// Writes lr1_raw, lr2_raw, lr1, ratio, lr2, e2, k3, k3c, evaluated (0 or 1), pgm = pg * m,
// klm = k3c * m and terms = pg m + kl_coef k3c m; positions not evaluated get the CPU's initial
// values (ratio = e2 = 1, the rest 0).
extern "C" __global__ void loss_forward_f32(const float *__restrict__ logp, const float *__restrict__ old_logp,
                                            const float *__restrict__ ref_logp, const float *__restrict__ mask,
                                            const float *__restrict__ adv, u64 n, u64 t, int safe, float lim,
                                            float lo, float hi, float k3_clamp, float kl_coef,
                                            float *__restrict__ lr1_raw,
                                            float *__restrict__ lr2_raw, float *__restrict__ lr1,
                                            float *__restrict__ ratio, float *__restrict__ lr2,
                                            float *__restrict__ e2, float *__restrict__ k3,
                                            float *__restrict__ k3c, float *__restrict__ evaluated,
                                            float *__restrict__ pgm, float *__restrict__ klm,
                                            float *__restrict__ terms) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const bool resp = mask[i] != 0.0f;
        lr1_raw[i] = logp[i] - old_logp[i];
        lr2_raw[i] = ref_logp[i] - logp[i];
        if (safe && !resp) {  // selected out: no exp, no term, no gradient
            lr1[i] = 0.0f;
            ratio[i] = 1.0f;
            lr2[i] = 0.0f;
            e2[i] = 1.0f;
            k3[i] = 0.0f;
            k3c[i] = 0.0f;
            evaluated[i] = 0.0f;
            pgm[i] = 0.0f;
            klm[i] = 0.0f;
            terms[i] = 0.0f;
            continue;
        }
        evaluated[i] = 1.0f;
        const float l1 = clampf(lr1_raw[i], -lim, lim), r = expf(l1);
        const float l2 = clampf(lr2_raw[i], -lim, lim), e = expf(l2);
        const float k = (e - 1.0f) - l2;
        lr1[i] = l1;
        ratio[i] = r;
        lr2[i] = l2;
        e2[i] = e;
        k3[i] = k;
        const float a = adv[i / t];
        const float surr1 = r * a, surr2 = clampf(r, lo, hi) * a;
        const float pg = -torch_min(surr1, surr2);
        const float kc = clampf(k, -k3_clamp, k3_clamp);
        const float m = safe ? 1.0f : mask[i];
        k3c[i] = kc;
        pgm[i] = pg * m;
        klm[i] = kc * m;
        terms[i] = pg * m + kl_coef * kc * m;
    }
}

// The token means and the stats, in one thread (grid 1 x 1): the CPU's loops in the CPU's order.
extern "C" __global__ void loss_reduce_f32(const float *__restrict__ logp, const float *__restrict__ mask,
                                           const float *__restrict__ lr1_raw, const float *__restrict__ lr2_raw,
                                           const float *__restrict__ ratio, const float *__restrict__ k3c,
                                           const float *__restrict__ evaluated, const float *__restrict__ pgm,
                                           const float *__restrict__ klm, u64 n, float kl_coef,
                                           float *__restrict__ stats) {
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
        if (evaluated[i] == 0.0f) continue;
        pg_sum += pgm[i];
        kl_sum += klm[i];
        if (mask[i] != 0.0f) {
            ratio_sum += ratio[i];
            kl_resp_sum += k3c[i];
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
// replaying PyTorch autograd's arithmetic for the graph loss_forward_f32 built. 0 where not
// evaluated. stats: loss_reduce_f32's (the divisor at STATS - 1).
extern "C" __global__ void loss_backward_f32(const float *__restrict__ mask, const float *__restrict__ adv, u64 n,
                                             u64 t, int safe, float lim, float lo, float hi, float k3_clamp,
                                             float kl_coef,
                                             const float *__restrict__ lr1_raw, const float *__restrict__ lr2_raw,
                                             const float *__restrict__ ratio, const float *__restrict__ e2,
                                             const float *__restrict__ k3, const float *__restrict__ evaluated,
                                             const float *__restrict__ stats, float *__restrict__ d_lr1,
                                             float *__restrict__ d_lr2, float *__restrict__ dlogp) {
    const float denom = stats[STATS - 1];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (evaluated[i] == 0.0f) {
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
