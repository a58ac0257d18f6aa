// The encoder (kernels/src/ops/embedding.rs): out[b, t] = wte[tok[b, t]] + wpe[t], and its backward,
// with the CPU's additions in the CPU's order, so every element has the CPU's bits.
//
// Backward accumulates each gradient element over the positions in increasing (b, t) order, as the
// CPU's loop does: one thread per (row, channel) keeps the running sum in a register. For dwte the
// host lists the positions of each distinct token (CSR: `rows` the token ids, `starts` where each
// one's positions begin in `order`, positions increasing), so the work is O(B T C) whatever V is.

typedef unsigned long long u64;

// out: (B, T, C), tokens: (B, T), wte: (V, C), wpe: (>= T, C). A token id >= V gives NaN (the host
// checks ids before it uploads them; the kernel never reads past wte).
extern "C" __global__ void encoder_forward_f32(float *__restrict__ out, const unsigned *__restrict__ tokens,
                                               const float *__restrict__ wte, const float *__restrict__ wpe,
                                               u64 bt, u64 t, u64 c, u64 v) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < bt * c; i += (u64)gridDim.x * blockDim.x) {
        const u64 row = i / c, j = i % c, tok = tokens[row], pos = row % t;
        out[i] = tok < v ? wte[tok * c + j] + wpe[pos * c + j] : __uint_as_float(0x7fc00000u);
    }
}

// dwte: (V, C) +=, dout: (B, T, C); block e takes token rows[e], its threads the channels.
// rows: (k), starts: (k + 1), order: (B T), positions sorted by (token, position).
extern "C" __global__ void encoder_backward_wte_f32(float *__restrict__ dwte, const float *__restrict__ dout,
                                                    const unsigned *__restrict__ rows,
                                                    const unsigned *__restrict__ starts,
                                                    const unsigned *__restrict__ order, u64 c) {
    const u64 e = blockIdx.x, tok = rows[e];
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) {
        float acc = dwte[tok * c + j];
        for (unsigned p = starts[e]; p < starts[e + 1]; p++) acc += dout[(u64)order[p] * c + j];
        dwte[tok * c + j] = acc;
    }
}

// dwpe: (>= T, C) +=, dout: (B, T, C); one thread per (position, channel), over b in order.
extern "C" __global__ void encoder_backward_wpe_f32(float *__restrict__ dwpe, const float *__restrict__ dout,
                                                    u64 b, u64 t, u64 c) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < t * c; i += (u64)gridDim.x * blockDim.x) {
        float acc = dwpe[i];
        for (u64 bi = 0; bi < b; bi++) acc += dout[bi * t * c + i];
        dwpe[i] = acc;
    }
}
