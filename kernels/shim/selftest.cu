// Kernels that break the CUDA rules the shim enforces, for its own test (kernels/tests/cuda_shim.rs):
// the shim must refuse the first and expose the second.

// Half the block waits at a barrier the other half never reaches (undefined behaviour in CUDA).
extern "C" __global__ void divergent_barrier(int *x) {
    if (threadIdx.x < 32) __syncthreads();
    if (threadIdx.x == 0) x[0] = 1;
}

// Reads a neighbour's shared word before the barrier that would make it written: the result
// depends on the schedule. The shared words are cleared after a barrier, for the next launch.
extern "C" __global__ void missing_barrier(int *out) {
    __shared__ int s[64];
    s[threadIdx.x] = threadIdx.x + 1;
    out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
    __syncthreads();
    s[threadIdx.x] = 0;
}
