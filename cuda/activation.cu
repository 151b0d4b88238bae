// Elementwise ops, all computed in float and stored in the activation dtype:
//   silu_and_mul / gelu_tanh_and_mul: out[t, i] = act(x[t, i]) * x[t, I + i]
//     silu(g) = g / (1 + expf(-g)) (expf, not __expf, to stay close to the CPU reference);
//     gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), PyTorch's
//     gelu(approximate='tanh');
//   softcap: x = cap * tanh(x / cap), in place (Gemma-2 logit soft-capping, F32 logits too);
//   scale: x = x * s, in place (Gemma's embedding times sqrt(hidden));
//   add_bias: out[t, n] += bias[n], in place;
//   clamped_swiglu (GPT-OSS's experts): g = min(x[t, i], limit), u = clip(x[t, I + i], -limit,
//     limit), out[t, i] = (u + 1) * g / (1 + expf(-alpha g)): the gate first, as silu_and_mul
//     (the model file puts its interleaved gate/up columns in that order at load). One element a
//     thread: the simple form, no packs.
//
// Grid-stride loops over 16-byte packs (8 bf16/f16 or 4 f32 per load and store) when the row
// length is a multiple of the pack and the pointers are 16-byte aligned (the launcher checks the
// pointer values), else over single elements. The row ops use a 2D grid, rows on y and packs on
// x, so no thread divides a flat index by the row length.
#include "common.cuh"

namespace {

struct Silu {
    __device__ __forceinline__ float operator()(float g) const { return g / (1.0f + expf(-g)); }
};

struct GeluTanh {
    __device__ __forceinline__ float operator()(float g) const {
        const float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
        const float kKappa = 0.044715f;
        return 0.5f * g * (1.0f + tanhf(kBeta * (g + kKappa * g * g * g)));
    }
};

// ---- kernels

template <typename T, int N, typename Act>
__global__ void act_and_mul_kernel(const T* __restrict__ x,  // (T, 2I)
                                   T* __restrict__ out,      // (T, I)
                                   int64_t T_, int64_t I) {
    using V = taper::Pack<T, N>;
    const int64_t np = I / N, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = blockIdx.y; t < T_; t += gridDim.y) {
        const T* g = x + t * 2 * I;
        T* o = out + t * I;
        for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np; p += stride) {
            const V a = *reinterpret_cast<const V*>(g + p * N);
            const V b = *reinterpret_cast<const V*>(g + I + p * N);
            V y;
#pragma unroll
            for (int j = 0; j < N; j++)
                y.v[j] = taper::from_float<T>(Act()(taper::to_float(a.v[j])) *
                                              taper::to_float(b.v[j]));
            *reinterpret_cast<V*>(o + p * N) = y;
        }
    }
}

template <typename T, int N>
__global__ void softcap_kernel(T* __restrict__ x,  // (n,) viewed as (np, N)
                               int64_t np, float cap) {
    using V = taper::Pack<T, N>;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np; p += stride) {
        V v = reinterpret_cast<V*>(x)[p];
#pragma unroll
        for (int j = 0; j < N; j++)
            v.v[j] = taper::from_float<T>(cap * tanhf(taper::to_float(v.v[j]) / cap));
        reinterpret_cast<V*>(x)[p] = v;
    }
}

template <typename T, int N>
__global__ void scale_kernel(T* __restrict__ x,  // (n,) viewed as (np, N)
                             int64_t np, float s) {
    using V = taper::Pack<T, N>;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np; p += stride) {
        V v = reinterpret_cast<V*>(x)[p];
#pragma unroll
        for (int j = 0; j < N; j++) v.v[j] = taper::from_float<T>(taper::to_float(v.v[j]) * s);
        reinterpret_cast<V*>(x)[p] = v;
    }
}

template <typename T, int N>
__global__ void add_bias_kernel(T* __restrict__ out,               // (T, Nc)
                                const float* __restrict__ bias,    // (Nc,)
                                int64_t T_, int64_t Nc) {
    using V = taper::Pack<T, N>;
    const int64_t np = Nc / N, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = blockIdx.y; t < T_; t += gridDim.y) {
        V* o = reinterpret_cast<V*>(out + t * Nc);
        for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np; p += stride) {
            V v = o[p];
            float b[N];
            taper::load_f32<N>(bias + p * N, b);
#pragma unroll
            for (int j = 0; j < N; j++)
                v.v[j] = taper::from_float<T>(taper::to_float(v.v[j]) + b[j]);
            o[p] = v;
        }
    }
}

// ---- launchers

// 256 threads: eight warps per block is enough to hide latency with several blocks resident
// per SM, and a row of Llama-3-8B's MLP (14336 bf16 = 1792 packs) still spreads over 7 blocks.
constexpr int kThreads = 256;

// A 2D grid for row ops: packs on x, rows on y (y is capped at 65535 by the hardware; the
// kernels' grid-stride loop over rows covers the rest).
dim3 row_grid(int64_t rows, int64_t packs) {
    const int64_t y = rows < 65535 ? rows : 65535;
    return dim3((unsigned)taper::ceil_div(packs, kThreads), (unsigned)y);
}

template <typename T, typename Act>
void launch_act_and_mul(const void* x, void* out, int64_t T_, int64_t I, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (I % V == 0 && taper::aligned16(x) && taper::aligned16(out))
        act_and_mul_kernel<T, V, Act><<<row_grid(T_, I / V), kThreads, 0, s>>>(
            (const T*)x, (T*)out, T_, I);
    else
        act_and_mul_kernel<T, 1, Act><<<row_grid(T_, I), kThreads, 0, s>>>(
            (const T*)x, (T*)out, T_, I);
}

template <typename T>
void launch_softcap(void* x, int64_t n, float cap, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && taper::aligned16(x);
    const int64_t np = vec ? n / V : n;
    // The grid-stride loop covers any n; 2^20 blocks is far more than fill the device.
    int64_t blocks = taper::ceil_div(np, kThreads);
    if (blocks > (1 << 20)) blocks = 1 << 20;
    if (vec)
        softcap_kernel<T, V><<<(unsigned)blocks, kThreads, 0, s>>>((T*)x, np, cap);
    else
        softcap_kernel<T, 1><<<(unsigned)blocks, kThreads, 0, s>>>((T*)x, np, cap);
}

template <typename T>
void launch_scale(void* x, int64_t n, float scale, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && taper::aligned16(x);
    const int64_t np = vec ? n / V : n;
    int64_t blocks = taper::ceil_div(np, kThreads);
    if (blocks > (1 << 20)) blocks = 1 << 20;  // the grid-stride loop covers the rest
    if (vec)
        scale_kernel<T, V><<<(unsigned)blocks, kThreads, 0, s>>>((T*)x, np, scale);
    else
        scale_kernel<T, 1><<<(unsigned)blocks, kThreads, 0, s>>>((T*)x, np, scale);
}

template <typename T>
void launch_add_bias(void* out, const float* bias, int64_t T_, int64_t Nc, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (Nc % V == 0 && taper::aligned16(out) && taper::aligned16(bias))
        add_bias_kernel<T, V><<<row_grid(T_, Nc / V), kThreads, 0, s>>>((T*)out, bias, T_, Nc);
    else
        add_bias_kernel<T, 1><<<row_grid(T_, Nc), kThreads, 0, s>>>((T*)out, bias, T_, Nc);
}

template <typename T>
__global__ void clamped_swiglu_kernel(const T* __restrict__ x,  // (T, 2I)
                                      T* __restrict__ out,      // (T, I)
                                      int64_t T_, int64_t I, float alpha, float limit) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < T_ * I; e += stride) {
        const int64_t t = e / I, i = e - t * I;
        const float g = fminf(taper::to_float(x[t * 2 * I + i]), limit);
        const float u = fminf(fmaxf(taper::to_float(x[t * 2 * I + I + i]), -limit), limit);
        out[e] = taper::from_float<T>((u + 1.0f) * (g / (1.0f + expf(-alpha * g))));
    }
}

template <typename T>
void launch_clamped_swiglu(const void* x, void* out, int64_t T_, int64_t I, float alpha,
                           float limit, cudaStream_t s) {
    int64_t blocks = taper::ceil_div(T_ * I, kThreads);
    if (blocks > (1 << 20)) blocks = 1 << 20;  // the grid-stride loop covers the rest
    clamped_swiglu_kernel<T><<<(unsigned)blocks, kThreads, 0, s>>>((const T*)x, (T*)out, T_, I,
                                                                   alpha, limit);
}

// Rows of up to 2^31 elements keep the x grid within its limit.
bool bad_rows(int64_t T, int64_t n) { return T < 0 || n < 0 || n > INT32_MAX; }

}  // namespace

extern "C" int taper_cuda_silu_and_mul(const void* x,  // (T, 2I) dtype
                                       void* out,      // (T, I) dtype
                                       int64_t T, int64_t I, int dtype, taper_stream_t stream) {
    if (bad_rows(T, I)) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || I == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_act_and_mul<scalar_t, Silu>(x, out, T, I, (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_gelu_tanh_and_mul(const void* x,  // (T, 2I) dtype
                                            void* out,      // (T, I) dtype
                                            int64_t T, int64_t I, int dtype,
                                            taper_stream_t stream) {
    if (bad_rows(T, I)) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || I == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_act_and_mul<scalar_t, GeluTanh>(x, out, T, I,
                                                                (cudaStream_t)stream));
    return taper::launch_status();
}

// cap must be positive: 0 (the attention kernels' "off") would turn every value into NaN or 0.
extern "C" int taper_cuda_softcap(void* x,  // (n,) dtype
                                  int64_t n, float cap, int dtype, taper_stream_t stream) {
    if (n < 0 || !(cap > 0.f)) return TAPER_CUDA_ERR_ARG;
    if (n == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_softcap<scalar_t>(x, n, cap, (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_scale(void* x,  // (n,) dtype
                                int64_t n, float s, int dtype, taper_stream_t stream) {
    if (n < 0) return TAPER_CUDA_ERR_ARG;
    if (n == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, launch_scale<scalar_t>(x, n, s, (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_add_bias(void* out,          // (T, N) dtype
                                   const float* bias,  // (N,)
                                   int64_t T, int64_t N, int dtype, taper_stream_t stream) {
    if (bad_rows(T, N)) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || N == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_add_bias<scalar_t>(out, bias, T, N, (cudaStream_t)stream));
    return taper::launch_status();
}

// limit must be positive (GPT-OSS's swiglu_limit, 7.0) and alpha finite.
extern "C" int taper_cuda_clamped_swiglu(const void* x,  // (T, 2I) dtype
                                         void* out,      // (T, I) dtype
                                         int64_t T, int64_t I, float alpha, float limit,
                                         int dtype, taper_stream_t stream) {
    if (bad_rows(T, I) || !(limit > 0.f) || !isfinite(alpha) || !isfinite(limit))
        return TAPER_CUDA_ERR_ARG;
    if (T == 0 || I == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_clamped_swiglu<scalar_t>(x, out, T, I, alpha, limit,
                                                         (cudaStream_t)stream));
    return taper::launch_status();
}
