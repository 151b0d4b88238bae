// The fused mixture-of-experts path (issue 16 item 2; pyx/moe.py is the block, the CPU backend's
// moe_* ops the reference):
//   moe_align:         the (token, slot) pairs of top-k routing sorted by expert, each expert's run
//                      padded to a multiple of the GEMM's M tile (vLLM's moe_align_block_size);
//   moe_grouped_gemm:  one launch for a projection of every expert: CTA (b, j) multiplies M tile b
//                      (block_m pair rows, all routed to expert block_expert[b]) by N tile j of
//                      that expert's weight, on tensor cores; weights bf16/f16 or GGUF Q8_0;
//   moe_combine:       out[t] = sum_j w[t, j] * y[t * k + j] (the weighted scatter back).
//
// The trick that needs no host round trip (so a decode step stays capturable in a CUDA Graph):
// the host sizes the grid for the worst case, ceil(P / block_m) + min(E, P) M tiles (each
// expert that holds a pair adds at most one partly filled tile), and the tiles past the padded
// total that moe_align wrote on the device exit at once.
//
// moe_align runs in one CTA: per-expert counts with shared-memory atomics, a serial prefix over
// the experts (E is at most a few hundred), then each pair takes its slot with an atomic, so the
// order of pairs inside an expert's run is unspecified (the GEMM's row results do not depend on
// it; the CPU reference keeps pair order). Pairs whose expert id is outside [0, E) are left out
// and moe_combine skips them.
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int kAlignThreads = 1024;
constexpr int kMaxExperts = 4096;   // moe_align's shared counters: 2 x 16 KB
constexpr int kThreads = 128;       // grouped GEMM: 4 warps
constexpr int kBN = 64;             // N tile: each warp owns 16 columns (two n8 MMA tiles)
constexpr int kBK = 32;             // K step: two k16 MMA steps, one Q8_0 block
constexpr int kPad = 8;             // shared rows of kBK + 8 elements (80 bytes): the fragment
                                    // loads of a warp's 8 row groups hit 8 distinct bank quads
constexpr int kQ8Bytes = 34;        // ggml block_q8_0: fp16 d, then 32 int8 codes

// ---- kernels

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int64_t* __restrict__ topk_ids,  // (P,) pairs, token-major
                     int32_t* __restrict__ sorted_ids,      // (capacity,) pair index, P = pad
                     int32_t* __restrict__ block_expert,    // (max_blocks,) -1 past the end
                     int32_t* __restrict__ expert_offsets,  // (E + 1,) padded run starts
                     int32_t* __restrict__ num_padded,      // (1,)
                     int P, int E, int block_m, int capacity, int max_blocks) {
    extern __shared__ int32_t smem[];
    int32_t* count = smem;       // (E,) pairs per expert, then the running slot per expert
    int32_t* start = smem + E;   // (E + 1,) padded run starts
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const int64_t e = topk_ids[i];
        if (e >= 0 && e < E) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int e = 0; e < E; e++) {
            start[e] = s;
            s += (count[e] + block_m - 1) / block_m * block_m;
        }
        start[E] = s;
        *num_padded = s;
    }
    __syncthreads();
    const int total = start[E];
    for (int e = threadIdx.x; e <= E; e += blockDim.x) expert_offsets[e] = start[e];
    for (int r = threadIdx.x; r < capacity; r += blockDim.x) sorted_ids[r] = P;
    for (int b = threadIdx.x; b < max_blocks; b += blockDim.x) block_expert[b] = -1;
    __syncthreads();  // the fills above before the writes below (same global addresses)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        for (int b = start[e] / block_m; b < start[e + 1] / block_m; b++) block_expert[b] = e;
        count[e] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const int64_t e = topk_ids[i];
        if (e >= 0 && e < E && total <= capacity) sorted_ids[start[e] + atomicAdd(&count[e], 1)] = i;
    }
}

// One 8-element slice of a weight row as T: kQ8 false reads T elements, true dequantizes
// d * q of Q8_0 codes (the CPU's scalar reference, rounded to T as the dequantize-then-cuBLAS path
// rounds it). `row` is the expert's row n; k a multiple of 8 inside one 32-element block.
template <typename T, bool kQ8>
__device__ __forceinline__ void load_w8(const uint8_t* row, int64_t k, T v[8]) {
    if constexpr (kQ8) {
        const uint8_t* blk = row + (k / 32) * kQ8Bytes;
        const float d = __half2float(*reinterpret_cast<const __half*>(blk));  // 2-byte aligned
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2 + k % 32);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = taper::from_float<T>(d * (float)q[i]);
    } else {
        *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(
            reinterpret_cast<const T*>(row) + k);
    }
}

// CTA (blockIdx.x, blockIdx.y) = (M tile b, N tile j). out[p, n] = sum_k x[p / x_div, k] *
// W[e][n, k] for the pairs p of tile b, e = block_expert[b]. kVec: K % 8 == 0 and 16-byte aligned
// rows, so activations and weights move 8 elements per load; else element by element (tiny
// checkpoints' odd sizes). Q8_0 weights always have K % 32 == 0.
template <typename T, int BM, bool kQ8, bool kVec>
__global__ void __launch_bounds__(kThreads)
    moe_grouped_gemm_kernel(const T* __restrict__ x,                // (rows, K)
                            const uint8_t* __restrict__ w,          // (E, N, row_bytes)
                            const int32_t* __restrict__ sorted_ids, // (capacity,)
                            const int32_t* __restrict__ block_expert,
                            const int32_t* __restrict__ num_padded,
                            T* __restrict__ out,                    // (P, N)
                            int P, int N, int K, int x_div, int64_t row_bytes) {
    const int b = blockIdx.x;
    if (b * BM >= *num_padded) return;  // past the padded total: nothing routed here
    const int e = block_expert[b];
    if (e < 0) return;
    __shared__ __align__(16) T As[BM][kBK + kPad];
    __shared__ __align__(16) T Bs[kBN][kBK + kPad];
    __shared__ int32_t pair[BM];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int n0 = blockIdx.y * kBN;
    for (int r = tid; r < BM; r += kThreads) pair[r] = sorted_ids[b * BM + r];
    __syncthreads();
    const uint8_t* we = w + (int64_t)e * N * row_bytes;

    float acc[BM / 16][2][4] = {};
    for (int k0 = 0; k0 < K; k0 += kBK) {
        // A: BM rows x 32 columns as 8-element slices; a padding row (pair P) reads zeros.
        for (int s = tid; s < BM * (kBK / 8); s += kThreads) {
            const int r = s / (kBK / 8), kk = s % (kBK / 8) * 8;
            const int p = pair[r];
            T* dst = &As[r][kk];
            const T* src = x + (int64_t)(p / x_div) * K + k0 + kk;
            if (kVec) {
                if (p < P && k0 + kk < K) *reinterpret_cast<uint4*>(dst) =
                    *reinterpret_cast<const uint4*>(src);
                else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    dst[i] = p < P && k0 + kk + i < K ? src[i] : taper::from_float<T>(0.f);
            }
        }
        // B: 64 weight rows x 32 columns.
        for (int s = tid; s < kBN * (kBK / 8); s += kThreads) {
            const int r = s / (kBK / 8), kk = s % (kBK / 8) * 8;
            const int n = n0 + r;
            T* dst = &Bs[r][kk];
            const uint8_t* row = we + (int64_t)n * row_bytes;
            if (kVec) {
                if (n < N && k0 + kk < K) load_w8<T, kQ8>(row, k0 + kk, dst);
                else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            } else {
                const T* src = reinterpret_cast<const T*>(row) + k0 + kk;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    dst[i] = n < N && k0 + kk + i < K ? src[i] : taper::from_float<T>(0.f);
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < kBK; ks += 16) {
            uint32_t bf[2][2];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const T* brow = &Bs[warp * 16 + j * 8 + g][ks + 2 * c];
                bf[j][0] = *reinterpret_cast<const uint32_t*>(brow);
                bf[j][1] = *reinterpret_cast<const uint32_t*>(brow + 8);
            }
#pragma unroll
            for (int m = 0; m < BM / 16; m++) {
                const T* a0 = &As[m * 16 + g][ks + 2 * c];
                const T* a1 = &As[m * 16 + g + 8][ks + 2 * c];
                const uint32_t af[4] = {*reinterpret_cast<const uint32_t*>(a0),
                                        *reinterpret_cast<const uint32_t*>(a1),
                                        *reinterpret_cast<const uint32_t*>(a0 + 8),
                                        *reinterpret_cast<const uint32_t*>(a1 + 8)};
#pragma unroll
                for (int j = 0; j < 2; j++) taper::mma_16816(acc[m][j], af, bf[j][0], bf[j][1],
                                                             (T*)nullptr);
            }
        }
        __syncthreads();
    }

    // C fragment: acc[m][j][0..1] = (row g, cols 2c, 2c+1), [2..3] = (row g + 8, same cols).
#pragma unroll
    for (int m = 0; m < BM / 16; m++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int p = pair[m * 16 + g + 8 * half];
            if (p >= P) continue;
            T* orow = out + (int64_t)p * N;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int n = n0 + warp * 16 + j * 8 + 2 * c;
                if (n < N) orow[n] = taper::from_float<T>(acc[m][j][2 * half]);
                if (n + 1 < N) orow[n + 1] = taper::from_float<T>(acc[m][j][2 * half + 1]);
            }
        }
    }
}

template <typename T>
__global__ void moe_combine_kernel(const T* __restrict__ y,                // (Tn * k, H)
                                   const float* __restrict__ weights,      // (Tn, k)
                                   const int64_t* __restrict__ topk_ids,   // (Tn, k)
                                   T* __restrict__ out,                    // (Tn, H)
                                   int64_t Tn, int k, int H, int E) {
    for (int64_t t = blockIdx.y; t < Tn; t += gridDim.y) {
        for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < H; h += gridDim.x * blockDim.x) {
            float s = 0.f;  // slot order, float: the CPU reference's sum
            for (int j = 0; j < k; j++) {
                const int64_t e = topk_ids[t * k + j];
                if (e >= 0 && e < E)
                    s += weights[t * k + j] * taper::to_float(y[(t * k + j) * H + h]);
            }
            out[t * H + h] = taper::from_float<T>(s);
        }
    }
}

// ---- launchers

template <typename T, int BM, bool kQ8>
int launch_gemm(const void* x, const uint8_t* w, const int32_t* sorted_ids,
                const int32_t* block_expert, const int32_t* num_padded, void* out, int64_t P,
                int64_t N, int64_t K, int64_t x_div, int64_t row_bytes, int64_t max_blocks,
                bool vec, cudaStream_t stream) {
    const dim3 grid((unsigned)max_blocks, (unsigned)taper::ceil_div(N, kBN));
    if (vec)
        moe_grouped_gemm_kernel<T, BM, kQ8, true><<<grid, kThreads, 0, stream>>>(
            (const T*)x, w, sorted_ids, block_expert, num_padded, (T*)out, (int)P, (int)N,
            (int)K, (int)x_div, row_bytes);
    else if constexpr (!kQ8)
        moe_grouped_gemm_kernel<T, BM, false, false><<<grid, kThreads, 0, stream>>>(
            (const T*)x, w, sorted_ids, block_expert, num_padded, (T*)out, (int)P, (int)N,
            (int)K, (int)x_div, row_bytes);
    else
        return TAPER_CUDA_ERR_ARG;
    return taper::launch_status();
}

template <typename T>
int dispatch_gemm(int wtype, int64_t block_m, const void* x, const uint8_t* w,
                  const int32_t* sorted_ids, const int32_t* block_expert,
                  const int32_t* num_padded, void* out, int64_t P, int64_t N, int64_t K,
                  int64_t x_div, int64_t row_bytes, int64_t max_blocks, bool vec,
                  cudaStream_t st) {
    // M tiles: 16 for decode-sized runs (a pair row padded to 16 wastes MMA work, never weight
    // bytes), 64 for prefill, where each weight tile loaded feeds 4x the rows.
    const bool q8 = wtype == TAPER_MOE_W_Q8_0;
#define TAPER_MOE_GEMM(BM, Q8) \
    launch_gemm<T, BM, Q8>(x, w, sorted_ids, block_expert, num_padded, out, P, N, K, x_div, \
                           row_bytes, max_blocks, vec, st)
    if (block_m == 16) return q8 ? TAPER_MOE_GEMM(16, true) : TAPER_MOE_GEMM(16, false);
    if (block_m == 64) return q8 ? TAPER_MOE_GEMM(64, true) : TAPER_MOE_GEMM(64, false);
#undef TAPER_MOE_GEMM
    return TAPER_CUDA_ERR_ARG;
}

}  // namespace

extern "C" int64_t taper_cuda_moe_align_capacity(int64_t P, int64_t E, int64_t block_m) {
    if (P < 0 || E < 1 || block_m < 1) return 0;
    const int64_t rows = P + (E < P ? E : P) * (block_m - 1);
    return taper::ceil_div(rows, block_m) * block_m;
}

extern "C" int taper_cuda_moe_align(const int64_t* topk_ids,  // (P,)
                                    int32_t* sorted_ids,      // (capacity,)
                                    int32_t* block_expert,    // (capacity / block_m,)
                                    int32_t* expert_offsets,  // (E + 1,)
                                    int32_t* num_padded,      // (1,)
                                    int64_t P, int64_t E, int64_t block_m,
                                    taper_stream_t stream) {
    if (P < 0 || E < 1 || E > kMaxExperts || block_m < 1 || block_m > 1024) return TAPER_CUDA_ERR_ARG;
    const int64_t capacity = taper_cuda_moe_align_capacity(P, E, block_m);
    if (capacity > INT32_MAX / 2) return TAPER_CUDA_ERR_ARG;
    // P == 0 (an empty step): zero-sized buffers may be null; the offsets and total are written.
    if ((P && (!topk_ids || !sorted_ids || !block_expert)) || !expert_offsets || !num_padded)
        return TAPER_CUDA_ERR_ARG;
    const size_t smem = (size_t)(2 * E + 1) * sizeof(int32_t);
    moe_align_kernel<<<1, kAlignThreads, smem, (cudaStream_t)stream>>>(
        topk_ids, sorted_ids, block_expert, expert_offsets, num_padded, (int)P, (int)E,
        (int)block_m, (int)capacity, (int)(capacity / block_m));
    return taper::launch_status();
}

extern "C" int taper_cuda_moe_grouped_gemm(const void* x,               // (rows, K) dtype
                                           const void* w,               // (E, N, K) or Q8_0
                                           int wtype,
                                           const int32_t* sorted_ids,   // (capacity,)
                                           const int32_t* block_expert, // (capacity / block_m,)
                                           const int32_t* num_padded,   // (1,)
                                           void* out,                   // (P, N) dtype
                                           int64_t P, int64_t E, int64_t N, int64_t K,
                                           int64_t x_div, int64_t block_m, int dtype,
                                           taper_stream_t stream) {
    if (P < 0 || E < 1 || N < 1 || K < 1 || x_div < 1) return TAPER_CUDA_ERR_ARG;
    if (wtype != TAPER_MOE_W_DTYPE && wtype != TAPER_MOE_W_Q8_0) return TAPER_CUDA_ERR_ARG;
    if (wtype == TAPER_MOE_W_Q8_0 && K % 32 != 0) return TAPER_CUDA_ERR_ARG;
    if (dtype != TAPER_DT_BF16 && dtype != TAPER_DT_F16) return TAPER_CUDA_ERR_ARG;  // MMA types
    const int64_t capacity = taper_cuda_moe_align_capacity(P, E, block_m);
    if (capacity > INT32_MAX / 2 || P * N > INT64_MAX / 2) return TAPER_CUDA_ERR_ARG;
    if (P == 0) return TAPER_CUDA_OK;
    if (!x || !w || !sorted_ids || !block_expert || !num_padded || !out) return TAPER_CUDA_ERR_ARG;
    const int64_t row_bytes = wtype == TAPER_MOE_W_Q8_0 ? K / 32 * kQ8Bytes : K * 2;
    // 16-byte slices: K % 8 == 0 keeps every row of x (and of a 16-bit W) 16-byte aligned.
    const bool vec = K % 8 == 0 && taper::aligned16(x) &&
                     (wtype == TAPER_MOE_W_Q8_0 || taper::aligned16(w));
    const int64_t max_blocks = capacity / block_m;
    const cudaStream_t st = (cudaStream_t)stream;
    if (dtype == TAPER_DT_BF16)
        return dispatch_gemm<__nv_bfloat16>(wtype, block_m, x, (const uint8_t*)w, sorted_ids,
                                            block_expert, num_padded, out, P, N, K, x_div,
                                            row_bytes, max_blocks, vec, st);
    return dispatch_gemm<__half>(wtype, block_m, x, (const uint8_t*)w, sorted_ids, block_expert,
                                 num_padded, out, P, N, K, x_div, row_bytes, max_blocks, vec, st);
}

extern "C" int taper_cuda_moe_combine(const void* y,             // (T * k, H) dtype
                                      const float* weights,      // (T, k)
                                      const int64_t* topk_ids,   // (T, k)
                                      void* out,                 // (T, H) dtype
                                      int64_t T, int64_t k, int64_t H, int64_t E, int dtype,
                                      taper_stream_t stream) {
    if (T < 0 || k < 1 || H < 1 || E < 1 || H > INT32_MAX / 2) return TAPER_CUDA_ERR_ARG;
    if (T == 0) return TAPER_CUDA_OK;
    if (!y || !weights || !topk_ids || !out) return TAPER_CUDA_ERR_ARG;
    const dim3 grid((unsigned)taper::ceil_div(H, 256), (unsigned)(T < 65535 ? T : 65535));
    TAPER_DISPATCH_DTYPE(dtype, E_,
                         moe_combine_kernel<E_><<<grid, 256, 0, (cudaStream_t)stream>>>(
                             (const E_*)y, weights, topk_ids, (E_*)out, T, (int)k, (int)H, (int)E));
    return taper::launch_status();
}
