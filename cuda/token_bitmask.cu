// Structured outputs: logits[rows[r], v] = -inf where bit v of the row's token bitmask is clear.
//
// The bitmask is llguidance's layout, one bit per token in int32 words (word v / 32, bit v % 32),
// computed on the host by the grammar matchers and copied up once per step. One thread per token:
// a warp's 32 threads read the same mask word (one broadcast load) and 32 consecutive logits, so
// the kernel is a single coalesced pass over the masked rows; allowed tokens are never written.
// Rows are the grid's y dimension (only constrained rows are listed), tokens its x dimension.
//
// A row index outside [0, B) is skipped: a device kernel cannot report a per-element error without
// a synchronization, and the CPU backend (which checks) is the reference.
#include "common.cuh"

namespace {

constexpr int kThreads = 256;

// ---- kernels

__global__ void apply_token_bitmask_kernel(float* __restrict__ logits,           // (B, V)
                                           const int32_t* __restrict__ bitmask,  // (B, W)
                                           const int32_t* __restrict__ rows,     // (R,)
                                           int64_t B, int64_t V, int64_t W) {
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int32_t b = rows[blockIdx.y];
    if (v >= V || b < 0 || b >= B) return;
    const uint32_t word = (uint32_t)bitmask[(int64_t)b * W + (v >> 5)];
    if (!((word >> (v & 31)) & 1u)) logits[(int64_t)b * V + v] = -INFINITY;
}

}  // namespace

// ---- launchers

extern "C" int taper_cuda_apply_token_bitmask(float* logits,           // (B, V)
                                              const int32_t* bitmask,  // (B, ceil(V / 32))
                                              const int32_t* rows,     // (R,)
                                              int64_t B, int64_t V, int64_t R,
                                              taper_stream_t stream) {
    if (B < 0 || V < 0 || R < 0 || V > INT32_MAX || R > 65535) return TAPER_CUDA_ERR_ARG;
    if (B == 0 || V == 0 || R == 0) return TAPER_CUDA_OK;
    if (!logits || !bitmask || !rows) return TAPER_CUDA_ERR_ARG;
    const dim3 grid((unsigned)taper::ceil_div(V, kThreads), (unsigned)R);
    apply_token_bitmask_kernel<<<grid, kThreads, 0, (cudaStream_t)stream>>>(
        logits, bitmask, rows, B, V, (V + 31) / 32);
    return taper::launch_status();
}
