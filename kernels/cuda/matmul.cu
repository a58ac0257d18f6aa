// The bias of the dense layer (kernels/src/ops/matmul.rs); the products themselves are cuBLAS's
// SGEMM (no TF32). Forward fills the output with the bias and the GEMM adds into it (beta = 1);
// backward sums dout's rows into dbias in row order, one thread per output channel, as the CPU does.

typedef unsigned long long u64;

// out: (BT, OC) = bias broadcast over the rows.
extern "C" __global__ void bias_fill_f32(float *__restrict__ out, const float *__restrict__ bias, u64 bt, u64 oc) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < bt * oc; e += (u64)gridDim.x * blockDim.x)
        out[e] = bias[e % oc];
}

// dbias: (OC) +=, dout: (BT, OC).
extern "C" __global__ void bias_backward_f32(float *__restrict__ dbias, const float *__restrict__ dout, u64 bt, u64 oc) {
    for (u64 o = (u64)blockIdx.x * blockDim.x + threadIdx.x; o < oc; o += (u64)gridDim.x * blockDim.x) {
        float acc = dbias[o];
        for (u64 i = 0; i < bt; i++) acc += dout[i * oc + o];
        dbias[o] = acc;
    }
}
