// KV cache write (reshape_and_cache): token t's K and V rows, (Hkv, D) each, go to cache slot
// slot_mapping[t] of the paged caches (NB, BS, Hkv, D), which are (NB * BS) rows of Hkv * D.
//
// The trick: a slot's Hkv * D elements are one contiguous run in the cache, as are the token's in
// k and v, so one block per token copies the whole row, coalesced, with 16-byte vectors where the
// row and the pointers allow it. An FP8 cache stores e4m3(x / scale[h]) (round to nearest even,
// saturated to +-448, NaN kept; DESIGN.md section 5); each thread converts 8 elements of one head
// and writes them as one 8-byte store.
//
// Slot -1 marks a padding row (CUDA-graph batch buckets) and is skipped. A slot outside
// [0, NB * BS) is skipped as well: the CPU op rejects such a call as a whole, but a kernel cannot
// report a per-token error: the engine's block tables make the slots, and the kernel only
// guarantees it never writes outside the caches.
#include "common.cuh"

namespace {

// 128 threads cover a Llama-sized row (8 KV heads x 128 dims of bf16 = 128 16-byte vectors) in
// one pass; larger rows loop, smaller ones leave threads idle, which costs nothing measurable for
// a kernel that moves a few KB per token.
constexpr int kThreads = 128;


// e4m3 code of x / s with IEEE division (as the CPU op), whatever the fast-math flags.
__device__ __forceinline__ uint32_t enc(float x, float s) {
    return taper::fp8_encode(__fdiv_rn(x, s));
}

// ---- kernels

// Same element type in and out: a plain copy. vec16: the row is a whole number of 16-byte
// vectors and every pointer is 16-byte aligned (checked by the launcher).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    cache_copy_kernel(const T* __restrict__ k,                   // (T, Hkv, D)
                      const T* __restrict__ v,                   // (T, Hkv, D)
                      T* __restrict__ k_cache,                   // (NB, BS, Hkv, D)
                      T* __restrict__ v_cache,                   // (NB, BS, Hkv, D)
                      const int32_t* __restrict__ slot_mapping,  // (T,)
                      int64_t row, int64_t nslots, bool vec16) {
    const int64_t t = blockIdx.x;
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= nslots) return;  // -1: padding row; beyond the cache: see the header
    const T* ks = k + t * row;
    const T* vs = v + t * row;
    T* kd = k_cache + slot * row;
    T* vd = v_cache + slot * row;
    if (vec16) {
        const int64_t n = row * (int64_t)sizeof(T) / 16;
        const uint4* ks4 = reinterpret_cast<const uint4*>(ks);
        const uint4* vs4 = reinterpret_cast<const uint4*>(vs);
        uint4* kd4 = reinterpret_cast<uint4*>(kd);
        uint4* vd4 = reinterpret_cast<uint4*>(vd);
#pragma unroll 1  // rows are short (one pass for most models); unrolling only spills
        for (int64_t i = threadIdx.x; i < n; i += kThreads) {
            kd4[i] = ks4[i];
            vd4[i] = vs4[i];
        }
    } else {
#pragma unroll 1
        for (int64_t i = threadIdx.x; i < row; i += kThreads) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}

// FP8 cache. vec8: D is a multiple of 8 (so 8 consecutive elements share a head) and the
// pointers are aligned for 16-byte loads and 8-byte stores (checked by the launcher).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    cache_fp8_kernel(const T* __restrict__ k,                   // (T, Hkv, D)
                     const T* __restrict__ v,                   // (T, Hkv, D)
                     uint8_t* __restrict__ k_cache,             // (NB, BS, Hkv, D) e4m3
                     uint8_t* __restrict__ v_cache,             // (NB, BS, Hkv, D) e4m3
                     const int32_t* __restrict__ slot_mapping,  // (T,)
                     const float* __restrict__ k_scale,         // (Hkv,)
                     const float* __restrict__ v_scale,         // (Hkv,)
                     int64_t Hkv, int64_t D, int64_t nslots, bool vec8) {
    const int64_t t = blockIdx.x;
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= nslots) return;  // -1: padding row; beyond the cache: see the header
    const int64_t row = Hkv * D;
    const T* ks = k + t * row;
    const T* vs = v + t * row;
    uint8_t* kd = k_cache + slot * row;
    uint8_t* vd = v_cache + slot * row;
    if (vec8) {
#pragma unroll 1
        for (int64_t i = threadIdx.x; i < row / 8; i += kThreads) {
            const int64_t e = 8 * i, h = e / D;
            const float sk = k_scale[h], sv = v_scale[h];
            float fk[8], fv[8];
            taper::load8(ks + e, fk);
            taper::load8(vs + e, fv);
            uint2 ck, cv;
            ck.x = enc(fk[0], sk) | enc(fk[1], sk) << 8 | enc(fk[2], sk) << 16 | enc(fk[3], sk) << 24;
            ck.y = enc(fk[4], sk) | enc(fk[5], sk) << 8 | enc(fk[6], sk) << 16 | enc(fk[7], sk) << 24;
            cv.x = enc(fv[0], sv) | enc(fv[1], sv) << 8 | enc(fv[2], sv) << 16 | enc(fv[3], sv) << 24;
            cv.y = enc(fv[4], sv) | enc(fv[5], sv) << 8 | enc(fv[6], sv) << 16 | enc(fv[7], sv) << 24;
            *reinterpret_cast<uint2*>(kd + e) = ck;
            *reinterpret_cast<uint2*>(vd + e) = cv;
        }
    } else {
#pragma unroll 1
        for (int64_t e = threadIdx.x; e < row; e += kThreads) {
            const int64_t h = e / D;
            kd[e] = (uint8_t)enc(taper::to_float(ks[e]), k_scale[h]);
            vd[e] = (uint8_t)enc(taper::to_float(vs[e]), v_scale[h]);
        }
    }
}

inline bool aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

template <typename T>
int launch_cache(const void* k, const void* v, void* k_cache, void* v_cache,
                 const int32_t* slot_mapping, const float* k_scale, const float* v_scale,
                 int64_t T_, int64_t Hkv, int64_t D, int64_t nslots, bool fp8,
                 cudaStream_t stream) {
    const int64_t row = Hkv * D;
    if (!fp8) {
        const bool vec16 = row * (int64_t)sizeof(T) % 16 == 0 && aligned(k, 16) &&
                           aligned(v, 16) && aligned(k_cache, 16) && aligned(v_cache, 16);
        cache_copy_kernel<T><<<(unsigned)T_, kThreads, 0, stream>>>(
            (const T*)k, (const T*)v, (T*)k_cache, (T*)v_cache, slot_mapping, row, nslots, vec16);
    } else {
        const bool vec8 = D % 8 == 0 && aligned(k, 16) && aligned(v, 16) &&
                          aligned(k_cache, 8) && aligned(v_cache, 8);
        cache_fp8_kernel<T><<<(unsigned)T_, kThreads, 0, stream>>>(
            (const T*)k, (const T*)v, (uint8_t*)k_cache, (uint8_t*)v_cache, slot_mapping, k_scale,
            v_scale, Hkv, D, nslots, vec8);
    }
    return taper::launch_status();
}

}  // namespace

// ---- launchers

extern "C" int taper_cuda_reshape_and_cache(const void* k,                // (T, Hkv, D) dtype
                                            const void* v,                // (T, Hkv, D) dtype
                                            void* k_cache,                // (NB, BS, Hkv, D)
                                            void* v_cache,                // (NB, BS, Hkv, D)
                                            const int32_t* slot_mapping,  // (T,)
                                            const float* k_scale,         // (Hkv,) FP8, or NULL
                                            const float* v_scale,         // (Hkv,) FP8, or NULL
                                            int64_t T, int64_t Hkv, int64_t D, int64_t NB,
                                            int64_t BS, int dtype, int cache_dtype,
                                            taper_stream_t stream) {
    if (T < 0 || T > INT32_MAX || Hkv < 1 || D < 1 || NB < 1 || BS < 1) return TAPER_CUDA_ERR_ARG;
    if (cache_dtype != dtype && cache_dtype != TAPER_DT_FP8) return TAPER_CUDA_ERR_ARG;
    const bool fp8 = cache_dtype == TAPER_DT_FP8;
    if (fp8 && (!k_scale || !v_scale)) return TAPER_CUDA_ERR_ARG;
    if (T == 0) return TAPER_CUDA_OK;
    if (!k || !v || !k_cache || !v_cache || !slot_mapping) return TAPER_CUDA_ERR_ARG;
    TAPER_DISPATCH_DTYPE(dtype, E,
                         return launch_cache<E>(k, v, k_cache, v_cache, slot_mapping, k_scale,
                                                v_scale, T, Hkv, D, NB * BS, fp8,
                                                (cudaStream_t)stream));
    return TAPER_CUDA_ERR_ARG;
}
