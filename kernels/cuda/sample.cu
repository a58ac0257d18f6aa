// The rollout's sampling (kernels/src/ops/sample.rs): one token per sequence from
// softmax(logits / temperature) of the sequence's last position, with the caller's uniform draw,
// by the inverse of the cumulative distribution in vocabulary order. The CPU's operations in the
// CPU's order, one thread per sequence: bitwise the CPU's choice up to expf.

typedef unsigned long long u64;

// out: (B) tokens; logits: (B, T, V), sequence i's row at (i T + T - 1) V; uniforms: (B) in [0, 1).
extern "C" __global__ void sample_f32(unsigned *__restrict__ out, const float *__restrict__ logits, u64 b, u64 t,
                                      u64 v, float temperature, const float *__restrict__ uniforms) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < b; i += (u64)gridDim.x * blockDim.x) {
        const float *row = logits + (i * t + t - 1) * v;
        float maxval = __uint_as_float(0xff800000u);  // -inf
        for (u64 j = 0; j < v; j++) maxval = fmaxf(maxval, row[j]);
        float total = -0.0f;
        for (u64 j = 0; j < v; j++) total += expf((row[j] - maxval) / temperature);
        float x = uniforms[i] * total;
        unsigned pick = (unsigned)(v - 1);
        for (u64 j = 0; j < v; j++) {
            const float p = expf((row[j] - maxval) / temperature);
            if (x < p) {
                pick = (unsigned)j;
                break;
            }
            x -= p;
        }
        out[i] = pick;
    }
}
