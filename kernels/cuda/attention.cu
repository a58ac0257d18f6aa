// Causal multi-head self-attention on a fused (B, T, 3C) q|k|v input (kernels/src/ops/attention.rs),
// with the CPU's operations in the CPU's order: every dot product, max, sum and weighted sum runs
// over its index in increasing order in one thread (no tree), masked weights are exactly 0 and take
// part in the products (0 * NaN = NaN spreads as in PyTorch). Bitwise the CPU's up to expf.
//
// Forward: one block per (sequence, head, query row); its threads take the keys, then the output
// channels. Backward in three launches: scores (one block per row: datt, the row's dot, dscore into
// a (B, NH, T, T) scratch), then dq (a thread per (b, h, t1, i), over t2 in order) and dk, dv (a
// thread per (b, h, t2, i), over t1 in order) - the orders in which the CPU's loops accumulate.

typedef unsigned long long u64;

#define NEG_INF __uint_as_float(0xff800000u)

// The query rows t0..t of causal attention over positions 0..t (a KV cache: row t2 of sequence b
// is inp[(b * stride + t2) * 3C ..]). out: (B, t - t0, C), att: (B, NH, t - t0, t),
// inp: (B, stride, 3C). Grid: B * NH * (t - t0) blocks.
extern "C" __global__ void attention_forward_f32(float *__restrict__ out, float *__restrict__ att,
                                                 const float *__restrict__ inp, u64 stride, u64 t0, u64 t,
                                                 u64 c, u64 nh) {
    const u64 hs = c / nh, c3 = 3 * c, tq = t - t0;
    const u64 row = blockIdx.x, bi = row / (nh * tq), h = row / tq % nh, r = row % tq, t1 = t0 + r;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *q = inp + (bi * stride + t1) * c3 + h * hs;
    float *a = att + row * t;
    for (u64 t2 = threadIdx.x; t2 < t; t2 += blockDim.x) {
        if (t2 > t1) {
            a[t2] = NEG_INF;
            continue;
        }
        const float *k = inp + (bi * stride + t2) * c3 + c + h * hs;
        float dot = -0.0f;
        for (u64 i = 0; i < hs; i++) dot += q[i] * k[i];
        a[t2] = dot * scale;
    }
    __syncthreads();
    __shared__ float shared_max, shared_sum;
    if (threadIdx.x == 0) {
        float maxval = NEG_INF;
        for (u64 t2 = 0; t2 <= t1; t2++) maxval = fmaxf(maxval, a[t2]);
        shared_max = maxval;
    }
    __syncthreads();
    const float maxval = shared_max;
    for (u64 t2 = threadIdx.x; t2 < t; t2 += blockDim.x) a[t2] = expf(a[t2] - maxval);  // exp(-inf) = 0
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (u64 t2 = 0; t2 < t; t2++) sum += a[t2];
        shared_sum = sum;
    }
    __syncthreads();
    const float sum = shared_sum;
    for (u64 t2 = threadIdx.x; t2 < t; t2 += blockDim.x) a[t2] /= sum;
    __syncthreads();
    for (u64 i = threadIdx.x; i < hs; i += blockDim.x) {
        float o = 0.0f;
        for (u64 t2 = 0; t2 < t; t2++) o += a[t2] * inp[(bi * stride + t2) * c3 + 2 * c + h * hs + i];
        out[(bi * tq + r) * c + h * hs + i] = o;
    }
}

// dscore: (B, NH, T, T) scratch = the gradient of the scaled scores (0 where masked),
// dout: (B, T, C), inp: (B, T, 3C), att: (B, NH, T, T). Grid: B * NH * T blocks.
extern "C" __global__ void attention_backward_scores_f32(float *__restrict__ dscore, const float *__restrict__ dout,
                                                         const float *__restrict__ inp,
                                                         const float *__restrict__ att, u64 t, u64 c, u64 nh) {
    const u64 hs = c / nh, c3 = 3 * c;
    const u64 row = blockIdx.x, bi = row / (nh * t), h = row / t % nh, t1 = row % t;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *a = att + row * t, *d = dout + (bi * t + t1) * c + h * hs;
    float *ds = dscore + row * t;
    for (u64 t2 = threadIdx.x; t2 < t; t2 += blockDim.x) {  // datt = dout v^T
        const float *v = inp + (bi * t + t2) * c3 + 2 * c + h * hs;
        float datt = -0.0f;
        for (u64 i = 0; i < hs; i++) datt += d[i] * v[i];
        ds[t2] = datt;
    }
    __syncthreads();
    __shared__ float shared_dot;
    if (threadIdx.x == 0) {
        float dot = -0.0f;
        for (u64 t2 = 0; t2 < t; t2++) dot += a[t2] * ds[t2];
        shared_dot = dot;
    }
    __syncthreads();
    const float dot = shared_dot;
    for (u64 t2 = threadIdx.x; t2 < t; t2 += blockDim.x) ds[t2] = t2 > t1 ? 0.0f : a[t2] * (ds[t2] - dot) * scale;
}

// dinp's q part +=: dq[b, t1] += sum over t2 in order of dscore[t1, t2] * k[t2]. One thread per
// (b, h, t1, i): B * T * C threads.
extern "C" __global__ void attention_backward_dq_f32(float *__restrict__ dinp, const float *__restrict__ dscore,
                                                     const float *__restrict__ inp, u64 b, u64 t, u64 c, u64 nh) {
    const u64 hs = c / nh, c3 = 3 * c;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < b * t * c; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e % hs, t1 = e / hs % t, h = e / (hs * t) % nh, bi = e / (hs * t * nh);
        const float *ds = dscore + ((bi * nh + h) * t + t1) * t;
        float *dq = dinp + (bi * t + t1) * c3 + h * hs + i;
        float acc = *dq;
        for (u64 t2 = 0; t2 < t; t2++) acc += ds[t2] * inp[(bi * t + t2) * c3 + c + h * hs + i];
        *dq = acc;
    }
}

// dinp's k and v parts +=: dk[t2] += dscore[t1, t2] * q[t1] and dv[t2] += att[t1, t2] * dout[t1],
// over t1 in order. One thread per (b, h, t2, i): B * T * C threads.
extern "C" __global__ void attention_backward_dkv_f32(float *__restrict__ dinp, const float *__restrict__ dscore,
                                                      const float *__restrict__ dout, const float *__restrict__ inp,
                                                      const float *__restrict__ att, u64 b, u64 t, u64 c, u64 nh) {
    const u64 hs = c / nh, c3 = 3 * c;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < b * t * c; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e % hs, t2 = e / hs % t, h = e / (hs * t) % nh, bi = e / (hs * t * nh);
        const u64 rows = (bi * nh + h) * t;
        float *dk = dinp + (bi * t + t2) * c3 + c + h * hs + i;
        float *dv = dk + c;
        float acck = *dk, accv = *dv;
        for (u64 t1 = 0; t1 < t; t1++) {
            accv += att[(rows + t1) * t + t2] * dout[(bi * t + t1) * c + h * hs + i];
            acck += dscore[(rows + t1) * t + t2] * inp[(bi * t + t1) * c3 + h * hs + i];
        }
        *dk = acck;
        *dv = accv;
    }
}
