// The rollout's sampling (worker/src/rollout.rs `sample`): for each sequence, the next token from
// softmax(logits / temperature), drawn with the step's xoshiro256** stream (kernels/src/rng.rs) in
// sequence order, or PAD after an EOS or PAD (no draw). The CPU's operations in the CPU's order:
// bitwise the CPU's choice up to expf.
//
// One block: thread 0 walks the sequences in order and draws the uniforms of those that sample (the
// stream is sequential), then the block's threads take one sequence each.

typedef unsigned long long u64;

#define NO_DRAW -1.0f

__device__ __forceinline__ u64 rotl(u64 x, int k) { return (x << k) | (x >> (64 - k)); }

__device__ u64 next_u64(u64 *s) {  // xoshiro256**, as Rng::next_u64
    const u64 r = rotl(s[1] * 5, 7) * 9;
    const u64 t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

// logits: row i at logits + i * row_stride + row_off, (V) each; seqs: (B, len), position `pos` is
// written from position pos - 1; may_stop: 1 when an EOS or PAD at pos - 1 ends the sequence;
// rng: the 4 words of the stream's state, advanced; u: (B) scratch.
extern "C" __global__ void sample_f32(const float *__restrict__ logits, u64 row_stride, u64 row_off, u64 v,
                                      unsigned *__restrict__ seqs, u64 b, u64 len, u64 pos, int may_stop,
                                      unsigned eos, unsigned pad, float temperature, u64 *__restrict__ rng,
                                      float *__restrict__ u) {
    if (threadIdx.x == 0) {
        u64 s[4] = {rng[0], rng[1], rng[2], rng[3]};
        for (u64 i = 0; i < b; i++) {
            const unsigned prev = seqs[i * len + pos - 1];
            u[i] = may_stop && (prev == eos || prev == pad)
                       ? NO_DRAW
                       : (float)(next_u64(s) >> 40) * (1.0f / 16777216.0f);  // Rng::uniform
        }
        for (int k = 0; k < 4; k++) rng[k] = s[k];
    }
    __syncthreads();
    for (u64 i = threadIdx.x; i < b; i += blockDim.x) {
        if (u[i] == NO_DRAW) {
            seqs[i * len + pos] = pad;
            continue;
        }
        const float *row = logits + i * row_stride + row_off;
        float maxval = __uint_as_float(0xff800000u);  // -inf
        for (u64 j = 0; j < v; j++) maxval = fmaxf(maxval, row[j]);
        float total = -0.0f;
        for (u64 j = 0; j < v; j++) total += expf((row[j] - maxval) / temperature);
        float x = u[i] * total;
        unsigned pick = (unsigned)(v - 1);
        for (u64 j = 0; j < v; j++) {
            const float p = expf((row[j] - maxval) / temperature);
            if (x < p) {
                pick = (unsigned)j;
                break;
            }
            x -= p;
        }
        seqs[i * len + pos] = pick;
    }
}
