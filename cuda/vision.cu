// Vision encoders' ops (pyx/backend.pyx gelu, encoder_attention), computed in float and stored
// in the activation dtype:
//   gelu: out = 0.5 x erfc(-x / sqrt(2)), the exact GELU (torch.nn.GELU()); erfcf rather than
//     1 + erff, which loses the small values of the negative tail to cancellation.
//   encoder_attention: bidirectional attention within packed segments, no mask, no cache.
//
// The prefill kernels (attention_prefill*.cu) read K/V through a paged cache and mask causally,
// so a ViT's window attention takes a kernel of its own: one block per (query tile of a
// segment, head). Its 128 threads hold 16 query rows, 8 threads per row; thread g of a row owns
// dims g, g + 8, g + 16, ... (so the 8 threads read 8 consecutive floats of a shared-memory key
// row, which the row's other readers share as broadcasts). K and V come through shared memory in
// tiles of TK keys as floats; the scores of a tile are reduced over the row's 8 threads with
// shuffles and folded into the running max, sum and output (online softmax, float throughout).
//
// The tiles of all segments are numbered in segment order; the grid has an upper bound of them
// (ceil(N / 16) + S, as each segment's last tile may be partial), and each block finds its
// segment by walking cu_seqlens (S is a few hundred windows, so the walk is short beside the
// block's key loop); blocks past the last tile return at once. The host never reads cu_seqlens,
// so the op needs no synchronization.
#include "common.cuh"

namespace {

constexpr int kRowThreads = 8;                          // threads per query row
constexpr int kThreads = 128;
constexpr int kRowsPerBlock = kThreads / kRowThreads;   // 16 query rows per block
constexpr int kMaxHeadDim = 256;

// ---- gelu

template <typename T, int N>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t np) {
    using V = taper::Pack<T, N>;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np; p += stride) {
        const V a = reinterpret_cast<const V*>(x)[p];
        V y;
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float g = taper::to_float(a.v[j]);
            y.v[j] = taper::from_float<T>(0.5f * g * erfcf(-g * 0.70710678118654752f));
        }
        reinterpret_cast<V*>(out)[p] = y;
    }
}

template <typename T>
void launch_gelu(const void* x, void* out, int64_t n, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && taper::aligned16(x) && taper::aligned16(out);
    const int64_t np = vec ? n / V : n;
    int64_t blocks = taper::ceil_div(np, 256);
    if (blocks > (1 << 20)) blocks = 1 << 20;  // the grid-stride loop covers the rest
    if (vec)
        gelu_kernel<T, V><<<(unsigned)blocks, 256, 0, s>>>((const T*)x, (T*)out, np);
    else
        gelu_kernel<T, 1><<<(unsigned)blocks, 256, 0, s>>>((const T*)x, (T*)out, np);
}

// ---- encoder_attention

// J: dims per thread (head_dim <= 8 J); TK: keys per shared-memory tile.
template <typename T, int J, int TK>
__global__ void __launch_bounds__(kThreads)
encoder_attention_kernel(T* __restrict__ out,              // (N, H, D)
                         const T* __restrict__ q,          // (N, H, D)
                         const T* __restrict__ k,          // (N, H, D)
                         const T* __restrict__ v,          // (N, H, D)
                         const int32_t* __restrict__ cu,   // (S + 1,)
                         int64_t S, int64_t H, int D, float scale) {
    extern __shared__ float smem[];
    float* ks = smem;             // (TK, D)
    float* vs = smem + TK * D;    // (TK, D)
    __shared__ int64_t tile_rows[3];  // first query row, segment start, segment end

    if (threadIdx.x == 0) {
        int64_t t = blockIdx.x, first = -1, start = 0, end = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t a = cu[s], b = cu[s + 1];
            const int64_t tiles = (b - a + kRowsPerBlock - 1) / kRowsPerBlock;
            if (t < tiles) {
                first = a + t * kRowsPerBlock, start = a, end = b;
                break;
            }
            t -= tiles;
        }
        tile_rows[0] = first, tile_rows[1] = start, tile_rows[2] = end;
    }
    __syncthreads();
    const int64_t first = tile_rows[0], start = tile_rows[1], end = tile_rows[2];
    if (first < 0) return;  // past the last tile: the whole block leaves together

    const int64_t h = blockIdx.y;
    const int g = threadIdx.x % kRowThreads;
    const int64_t row = first + threadIdx.x / kRowThreads;
    const bool live = row < end;  // rows past the segment still take part in the shuffles

    float qf[J], acc[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int d = g + kRowThreads * j;
        qf[j] = live && d < D ? taper::to_float(q[(row * H + h) * D + d]) * scale : 0.f;
        acc[j] = 0.f;
    }
    float m = -INFINITY, l = 0.f;

    for (int64_t k0 = start; k0 < end; k0 += TK) {
        const int n = end - k0 < TK ? (int)(end - k0) : TK;
        __syncthreads();  // the previous tile is no longer read
        for (int i = threadIdx.x; i < n * D; i += kThreads) {
            const int key = i / D, d = i - key * D;
            const int64_t at = ((k0 + key) * H + h) * D + d;
            ks[i] = taper::to_float(k[at]);
            vs[i] = taper::to_float(v[at]);
        }
        __syncthreads();

        float sc[TK];
        float tile_max = -INFINITY;
#pragma unroll
        for (int i = 0; i < TK; i++) {
            float dot = 0.f;
            if (i < n) {
#pragma unroll
                for (int j = 0; j < J; j++) {
                    const int d = g + kRowThreads * j;
                    if (d < D) dot += qf[j] * ks[i * D + d];
                }
            }
            // the row's 8 threads are 8 consecutive lanes: xor 4, 2, 1 stays inside them
            dot += __shfl_xor_sync(0xffffffffu, dot, 4);
            dot += __shfl_xor_sync(0xffffffffu, dot, 2);
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            sc[i] = i < n ? dot : -INFINITY;
            tile_max = fmaxf(tile_max, sc[i]);
        }
        const float m_new = fmaxf(m, tile_max);  // finite: the tile has at least one key
        const float correction = expf(m - m_new);
        l *= correction;
#pragma unroll
        for (int j = 0; j < J; j++) acc[j] *= correction;
#pragma unroll
        for (int i = 0; i < TK; i++) {
            if (i < n) {
                const float p = expf(sc[i] - m_new);
                l += p;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    const int d = g + kRowThreads * j;
                    if (d < D) acc[j] += p * vs[i * D + d];
                }
            }
        }
        m = m_new;
    }

    if (!live) return;
    const float inv = 1.f / l;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int d = g + kRowThreads * j;
        if (d < D) out[(row * H + h) * D + d] = taper::from_float<T>(acc[j] * inv);
    }
}

template <typename T, int J, int TK>
int launch_encoder_attention(void* out, const void* q, const void* k, const void* v,
                             const int32_t* cu, int64_t N, int64_t S, int64_t H, int D,
                             float scale, cudaStream_t s) {
    const size_t smem = 2 * (size_t)TK * D * sizeof(float);
    auto kernel = encoder_attention_kernel<T, J, TK>;
    const int64_t tiles = taper::ceil_div(N, kRowsPerBlock) + S;
    if (tiles > INT32_MAX || H > 65535) return TAPER_CUDA_ERR_ARG;
    kernel<<<dim3((unsigned)tiles, (unsigned)H), kThreads, smem, s>>>(
        (T*)out, (const T*)q, (const T*)k, (const T*)v, cu, S, H, D, scale);
    return taper::launch_status();
}

template <typename T>
int dispatch_encoder_attention(void* out, const void* q, const void* k, const void* v,
                               const int32_t* cu, int64_t N, int64_t S, int64_t H, int D,
                               float scale, cudaStream_t s) {
    // shared memory 2 TK D floats: 32 KiB at D = 128 with TK 32, and at D = 256 with TK 16
    if (D <= 64)
        return launch_encoder_attention<T, 8, 32>(out, q, k, v, cu, N, S, H, D, scale, s);
    if (D <= 128)
        return launch_encoder_attention<T, 16, 32>(out, q, k, v, cu, N, S, H, D, scale, s);
    return launch_encoder_attention<T, 32, 16>(out, q, k, v, cu, N, S, H, D, scale, s);
}

}  // namespace

extern "C" int taper_cuda_gelu(const void* x,  // (n,) dtype
                               void* out,      // (n,) dtype
                               int64_t n, int dtype, taper_stream_t stream) {
    if (n < 0) return TAPER_CUDA_ERR_ARG;
    if (n == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, launch_gelu<scalar_t>(x, out, n, (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_encoder_attention(void* out,               // (N, H, D) dtype
                                            const void* q,           // (N, H, D) dtype
                                            const void* k,           // (N, H, D) dtype
                                            const void* v,           // (N, H, D) dtype
                                            const int32_t* cu_seqlens,  // (S + 1,)
                                            int64_t N, int64_t S, int64_t H, int64_t D,
                                            float scale, int dtype, taper_stream_t stream) {
    if (N < 0 || S < 0 || H < 0 || D <= 0 || D > kMaxHeadDim) return TAPER_CUDA_ERR_ARG;
    if (N == 0 || S == 0 || H == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         return dispatch_encoder_attention<scalar_t>(
                             out, q, k, v, cu_seqlens, N, S, H, (int)D, scale,
                             (cudaStream_t)stream));
    return TAPER_CUDA_OK;
}
