// Log-softmax over the vocabulary gathered at one target per row (kernels/src/ops/softmax.rs), with
// the CPU's operations in the CPU's order: the row's max and sum of exps in index order by one
// thread per row. Bitwise the CPU's up to expf and logf.

typedef unsigned long long u64;

// logp: (N), lse: (N), logits: (N, V), targets: (N). One thread per row. A target >= V gives NaN
// (the host checks targets; the kernel never reads past the row).
extern "C" __global__ void logsoftmax_gather_forward_f32(float *__restrict__ logp, float *__restrict__ lse,
                                                         const float *__restrict__ logits,
                                                         const unsigned *__restrict__ targets, u64 n, u64 v) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float *row = logits + i * v;
        float maxval = __uint_as_float(0xff800000u);  // -inf
        for (u64 j = 0; j < v; j++) maxval = fmaxf(maxval, row[j]);
        float sum = -0.0f;
        for (u64 j = 0; j < v; j++) sum += expf(row[j] - maxval);
        const u64 tgt = targets[i];
        lse[i] = maxval + logf(sum);
        logp[i] = tgt < v ? (row[tgt] - maxval) - logf(sum) : __uint_as_float(0x7fc00000u);
    }
}

// dlogits: (N, V) +=, dlogp: (N), logits: (N, V), lse: (N), targets: (N). Elementwise over N V.
extern "C" __global__ void logsoftmax_gather_backward_f32(float *__restrict__ dlogits, const float *__restrict__ dlogp,
                                                          const float *__restrict__ logits,
                                                          const float *__restrict__ lse,
                                                          const unsigned *__restrict__ targets, u64 n, u64 v) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n * v; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e / v, j = e % v;
        const float g = dlogp[i];
        const float onehot = j == targets[i] ? g : 0.0f;
        dlogits[e] += onehot - expf(logits[e] - lse[i]) * g;
    }
}
