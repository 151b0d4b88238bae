// Embedding gather: out[t, :] = table[token_ids[t], :], in the activation dtype.
//
// One block per token row; consecutive threads copy consecutive chunks, so each warp moves one
// contiguous span per instruction. The trick is the copy unit: when a row is a multiple of 16
// bytes and both pointers are 16-byte aligned (the launcher checks the pointer values), the
// kernel is instantiated on uint4 and moves 16 bytes per load and store; otherwise it copies one
// element at a time.
//
// A token id outside [0, V) writes a zero row. The CPU kernel returns an error instead, but a
// device kernel cannot report a per-element error without a synchronization; the engine checks
// prompt ids against the vocabulary when a request arrives.
#include "common.cuh"

namespace {

// ---- kernels

// U is the copy unit: uint4 on the vector path, else the element type itself.
template <typename U>
__global__ void embedding_kernel(const int32_t* __restrict__ token_ids,  // (T,)
                                 const U* __restrict__ table,            // (V, n) units
                                 U* __restrict__ out,                    // (T, n) units
                                 int64_t V, int n) {
    const int64_t t = blockIdx.x;
    const int32_t id = token_ids[t];
    U* o = out + t * n;
    if (id < 0 || id >= V) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = U{};
        return;
    }
    const U* row = table + (int64_t)id * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = row[i];
}

// ---- launchers

template <typename U>
void launch_embedding(const int32_t* token_ids, const void* table, void* out, int64_t T,
                      int64_t V, int n, cudaStream_t stream) {
    // One thread per unit up to 512 (a 4096-wide bf16 row is 512 uint4), so every load of a row
    // is in flight at once; the cap keeps four blocks resident per SM.
    const int threads = n >= 512 ? 512 : (int)taper::ceil_div(n, 32) * 32;
    embedding_kernel<U><<<(unsigned)T, threads, 0, stream>>>(
        token_ids, (const U*)table, (U*)out, V, n);
}

}  // namespace

extern "C" int taper_cuda_embedding(const int32_t* token_ids,  // (T,)
                                    const void* table,         // (V, H) dtype
                                    void* out,                 // (T, H) dtype
                                    int64_t T, int64_t V, int64_t H, int dtype,
                                    taper_stream_t stream) {
    if (T < 0 || V < 0 || H < 0 || T > INT32_MAX || H > INT32_MAX / 4) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || H == 0) return TAPER_CUDA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        const int64_t bytes = H * (int64_t)sizeof(scalar_t);
        if (bytes % 16 == 0 && taper::aligned16(table) && taper::aligned16(out))
            launch_embedding<uint4>(token_ids, table, out, T, V, (int)(bytes / 16), s);
        else
            launch_embedding<scalar_t>(token_ids, table, out, T, V, (int)H, s);
    });
    return taper::launch_status();
}
