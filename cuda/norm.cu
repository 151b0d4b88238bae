// RMSNorm and fused residual-add + RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight, computed
// in float as the CPU kernel writes it (x * (1 / sqrtf(ss / H + eps)) * w), stored in dtype.
//
// One block per row makes two passes: the first sums squares into a float and reduces them over
// the block (block_sum), the second re-reads the row (an L1/L2 hit: DRAM sees each byte once)
// and writes the normalized values. The trick is the access unit: when the row is a multiple of
// 16 bytes and every pointer is 16-byte aligned (the launcher checks the pointer values), each
// thread moves a 16-byte pack of 8 bf16/f16 or 4 f32 per load and store; otherwise one element.
//
// The fused kernel stores residual + x rounded to dtype and takes the norm of that rounded value,
// so the next layer sees exactly the residual that is stored (vLLM does the same). x and out may
// be the same buffer: each thread reads an element before writing that element only.
//
// LayerNorm (StableLM) and its fused residual-add form: out = (x - mean) / sqrt(var + eps) * w + b
// (b optional), the variance taken around the mean in a second pass as the CPU kernel does.
#include "common.cuh"

namespace {

// ---- kernels

template <typename T, int N>
__global__ void rms_norm_kernel(const T* x,                        // (T, H)
                                const float* __restrict__ weight,  // (H,)
                                T* out,                            // (T, H)
                                int H, float eps) {
    using P = taper::Pack<T, N>;
    __shared__ float scratch[32];
    const P* xr = reinterpret_cast<const P*>(x + (int64_t)blockIdx.x * H);
    P* o = reinterpret_cast<P*>(out + (int64_t)blockIdx.x * H);
    const int np = H / N;
    float ss = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const P v = xr[p];
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float f = taper::to_float(v.v[j]);
            ss += f * f;
        }
    }
    const float r = 1.0f / sqrtf(taper::block_sum(ss, scratch) / (float)H + eps);
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const P v = xr[p];
        float w[N];
        taper::load_f32<N>(weight + p * N, w);
        P y;
#pragma unroll
        for (int j = 0; j < N; j++)
            y.v[j] = taper::from_float<T>(taper::to_float(v.v[j]) * r * w[j]);
        o[p] = y;
    }
}

// residual + x of one pack, rounded to T (the fused-add norms' new residual).
template <typename T, int N>
__device__ __forceinline__ taper::Pack<T, N> add_packs(const taper::Pack<T, N> x,
                                                       const taper::Pack<T, N> residual) {
    taper::Pack<T, N> s;
#pragma unroll
    for (int j = 0; j < N; j++)
        s.v[j] = taper::from_float<T>(taper::to_float(residual.v[j]) + taper::to_float(x.v[j]));
    return s;
}

template <typename T, int N>
__global__ void fused_add_rms_norm_kernel(T* x,                              // (T, H)
                                          T* residual,                       // (T, H)
                                          const float* __restrict__ weight,  // (H,)
                                          int H, float eps) {
    using P = taper::Pack<T, N>;
    __shared__ float scratch[32];
    P* xr = reinterpret_cast<P*>(x + (int64_t)blockIdx.x * H);
    P* rr = reinterpret_cast<P*>(residual + (int64_t)blockIdx.x * H);
    const int np = H / N;
    float ss = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const P s = add_packs<T, N>(xr[p], rr[p]);
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float f = taper::to_float(s.v[j]);  // the rounded, stored value
            ss += f * f;
        }
        rr[p] = s;
    }
    const float r = 1.0f / sqrtf(taper::block_sum(ss, scratch) / (float)H + eps);
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const P s = rr[p];  // written by this same thread in the first pass
        float w[N];
        taper::load_f32<N>(weight + p * N, w);
        P y;
#pragma unroll
        for (int j = 0; j < N; j++)
            y.v[j] = taper::from_float<T>(taper::to_float(s.v[j]) * r * w[j]);
        xr[p] = y;
    }
}

// Mean and 1 / sqrt(var + eps) of a row of np packs (three reads of the row; the last two hit
// the cache).
template <typename T, int N>
__device__ __forceinline__ float2 row_moments(const taper::Pack<T, N>* xr, int np, int H,
                                              float eps, float* scratch) {
    float sum = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const taper::Pack<T, N> v = xr[p];
#pragma unroll
        for (int j = 0; j < N; j++) sum += taper::to_float(v.v[j]);
    }
    const float mean = taper::block_sum(sum, scratch) / (float)H;
    float sq = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const taper::Pack<T, N> v = xr[p];
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float d = taper::to_float(v.v[j]) - mean;
            sq += d * d;
        }
    }
    return make_float2(mean, 1.0f / sqrtf(taper::block_sum(sq, scratch) / (float)H + eps));
}

// out = layer_norm(src) with weight w and bias b (nullptr: none).
template <typename T, int N>
__device__ __forceinline__ void write_layer_norm(const taper::Pack<T, N>* src,
                                                 taper::Pack<T, N>* out, const float* w,
                                                 const float* b, int np, float2 m) {
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const taper::Pack<T, N> v = src[p];
        float wv[N], bv[N];
        taper::load_f32<N>(w + p * N, wv);
        if (b) taper::load_f32<N>(b + p * N, bv);
        taper::Pack<T, N> y;
#pragma unroll
        for (int j = 0; j < N; j++)
            y.v[j] = taper::from_float<T>((taper::to_float(v.v[j]) - m.x) * m.y * wv[j] +
                                          (b ? bv[j] : 0.f));
        out[p] = y;
    }
}

template <typename T, int N>
__global__ void layer_norm_kernel(const T* x,                        // (T, H)
                                  const float* __restrict__ weight,  // (H,)
                                  const float* __restrict__ bias,    // (H,) or nullptr
                                  T* out,                            // (T, H)
                                  int H, float eps) {
    using P = taper::Pack<T, N>;
    __shared__ float scratch[32];
    const P* xr = reinterpret_cast<const P*>(x + (int64_t)blockIdx.x * H);
    const float2 m = row_moments<T, N>(xr, H / N, H, eps, scratch);
    write_layer_norm<T, N>(xr, reinterpret_cast<P*>(out + (int64_t)blockIdx.x * H), weight, bias,
                           H / N, m);
}

template <typename T, int N>
__global__ void fused_add_layer_norm_kernel(T* x,                              // (T, H)
                                            T* residual,                       // (T, H)
                                            const float* __restrict__ weight,  // (H,)
                                            const float* __restrict__ bias,    // (H,) or nullptr
                                            int H, float eps) {
    using P = taper::Pack<T, N>;
    __shared__ float scratch[32];
    P* xr = reinterpret_cast<P*>(x + (int64_t)blockIdx.x * H);
    P* rr = reinterpret_cast<P*>(residual + (int64_t)blockIdx.x * H);
    const int np = H / N;
    for (int p = threadIdx.x; p < np; p += blockDim.x)
        rr[p] = add_packs<T, N>(xr[p], rr[p]);  // the rounded, stored value is what gets normalized
    // Each thread re-reads only the packs it wrote, so no barrier is needed before the moments.
    const float2 m = row_moments<T, N>(rr, np, H, eps, scratch);
    write_layer_norm<T, N>(rr, xr, weight, bias, np, m);
}

// ---- launchers

// One thread per pack up to 512 (a 4096-wide bf16 row is 512 packs), so a row's loads are all in
// flight at once; the cap keeps four blocks resident per SM. Multiples of 32 keep every warp
// whole for block_sum's full-mask shuffles.
int norm_threads(int np) { return np >= 512 ? 512 : (int)taper::ceil_div(np, 32) * 32; }

template <typename T>
void launch_rms_norm(const void* x, const float* weight, void* out, int64_t T_, int H, float eps,
                     cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (H % V == 0 && taper::aligned16(x) && taper::aligned16(weight) && taper::aligned16(out))
        rms_norm_kernel<T, V><<<(unsigned)T_, norm_threads(H / V), 0, s>>>(
            (const T*)x, weight, (T*)out, H, eps);
    else
        rms_norm_kernel<T, 1><<<(unsigned)T_, norm_threads(H), 0, s>>>(
            (const T*)x, weight, (T*)out, H, eps);
}

template <typename T>
void launch_fused_add_rms_norm(void* x, void* residual, const float* weight, int64_t T_, int H,
                               float eps, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (H % V == 0 && taper::aligned16(x) && taper::aligned16(residual) && taper::aligned16(weight))
        fused_add_rms_norm_kernel<T, V><<<(unsigned)T_, norm_threads(H / V), 0, s>>>(
            (T*)x, (T*)residual, weight, H, eps);
    else
        fused_add_rms_norm_kernel<T, 1><<<(unsigned)T_, norm_threads(H), 0, s>>>(
            (T*)x, (T*)residual, weight, H, eps);
}

template <typename T>
void launch_layer_norm(const void* x, const float* weight, const float* bias, void* out,
                       int64_t T_, int H, float eps, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (H % V == 0 && taper::aligned16(x) && taper::aligned16(weight) && taper::aligned16(out) &&
        (!bias || taper::aligned16(bias)))
        layer_norm_kernel<T, V><<<(unsigned)T_, norm_threads(H / V), 0, s>>>(
            (const T*)x, weight, bias, (T*)out, H, eps);
    else
        layer_norm_kernel<T, 1><<<(unsigned)T_, norm_threads(H), 0, s>>>(
            (const T*)x, weight, bias, (T*)out, H, eps);
}

template <typename T>
void launch_fused_add_layer_norm(void* x, void* residual, const float* weight, const float* bias,
                                 int64_t T_, int H, float eps, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (H % V == 0 && taper::aligned16(x) && taper::aligned16(residual) &&
        taper::aligned16(weight) && (!bias || taper::aligned16(bias)))
        fused_add_layer_norm_kernel<T, V><<<(unsigned)T_, norm_threads(H / V), 0, s>>>(
            (T*)x, (T*)residual, weight, bias, H, eps);
    else
        fused_add_layer_norm_kernel<T, 1><<<(unsigned)T_, norm_threads(H), 0, s>>>(
            (T*)x, (T*)residual, weight, bias, H, eps);
}

}  // namespace

extern "C" int taper_cuda_rms_norm(const void* x,        // (T, H) dtype
                                   const float* weight,  // (H,)
                                   void* out,            // (T, H) dtype
                                   int64_t T, int64_t H, float eps, int dtype,
                                   taper_stream_t stream) {
    if (T < 0 || H < 0 || T > INT32_MAX || H > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || H == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_rms_norm<scalar_t>(x, weight, out, T, (int)H, eps,
                                                   (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_fused_add_rms_norm(void* x,              // (T, H) dtype
                                             void* residual,       // (T, H) dtype
                                             const float* weight,  // (H,)
                                             int64_t T, int64_t H, float eps, int dtype,
                                             taper_stream_t stream) {
    if (T < 0 || H < 0 || T > INT32_MAX || H > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || H == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_fused_add_rms_norm<scalar_t>(x, residual, weight, T, (int)H, eps,
                                                             (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_layer_norm(const void* x,        // (T, H) dtype
                                     const float* weight,  // (H,)
                                     const float* bias,    // (H,) or NULL
                                     void* out,            // (T, H) dtype
                                     int64_t T, int64_t H, float eps, int dtype,
                                     taper_stream_t stream) {
    if (T < 0 || H < 0 || T > INT32_MAX || H > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || H == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_layer_norm<scalar_t>(x, weight, bias, out, T, (int)H, eps,
                                                     (cudaStream_t)stream));
    return taper::launch_status();
}

extern "C" int taper_cuda_fused_add_layer_norm(void* x,              // (T, H) dtype
                                               void* residual,       // (T, H) dtype
                                               const float* weight,  // (H,)
                                               const float* bias,    // (H,) or NULL
                                               int64_t T, int64_t H, float eps, int dtype,
                                               taper_stream_t stream) {
    if (T < 0 || H < 0 || T > INT32_MAX || H > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || H == 0) return TAPER_CUDA_OK;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         launch_fused_add_layer_norm<scalar_t>(x, residual, weight, bias, T,
                                                               (int)H, eps,
                                                               (cudaStream_t)stream));
    return taper::launch_status();
}
