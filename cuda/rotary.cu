// Rotary position embedding, in place on the first rot_dim dims of every q and k head.
//
// Pair i of a head rotates by the angle of the token's position: with c = cache[pos][i] and
// s = cache[pos][rot_dim/2 + i], (a, b) -> (a c - b s, b c + a s), in float. neox pairs are
// (x[i], x[i + rot_dim/2]); interleaved (GPT-J) pairs are (x[2i], x[2i+1]). Dims past rot_dim
// are left as they are (partial rotary).
//
// One block per token; its threads walk (head, group of P pairs) over the q heads then the k
// heads, so consecutive threads touch consecutive memory. The trick is the group: when the
// shapes and pointers allow (the launcher checks the pointer values), a thread moves 16 bytes
// per load and store (neox: two packs of P elements at i and i + rot_dim/2; interleaved: one pack
// of P pairs) and reads its cos/sin as float4; otherwise P = 1.
//
// A position outside [0, max_pos) leaves its token's q and k rows unchanged. The CPU kernel
// returns an error instead, but a device kernel cannot report a per-element error without a
// synchronization; the engine never schedules a position past max_model_len <= max_pos.
#include "common.cuh"

namespace {

// ---- kernels

// P pairs per thread; NEOX picks the pairing.
template <typename T, int P, bool NEOX>
__global__ void rotary_kernel(const int32_t* __restrict__ positions,      // (T,)
                              T* __restrict__ q,                          // (T, Hq, D)
                              T* __restrict__ k,                          // (T, Hkv, D)
                              const float* __restrict__ cos_sin_cache,    // (max_pos, rot_dim)
                              int Hq, int Hkv, int D, int rot_dim, int64_t max_pos) {
    const int64_t t = blockIdx.x;
    const int32_t pos = positions[t];
    if (pos < 0 || pos >= max_pos) return;  // no barrier below, so an early exit is safe
    const int half = rot_dim / 2, groups = half / P;
    const float* cs = cos_sin_cache + (int64_t)pos * rot_dim;
    for (int w = threadIdx.x; w < (Hq + Hkv) * groups; w += blockDim.x) {
        const int h = w / groups, i = (w - h * groups) * P;
        T* x = h < Hq ? q + (t * Hq + h) * D : k + (t * Hkv + (h - Hq)) * D;
        float c[P], s[P];
        taper::load_f32<P>(cs + i, c);
        taper::load_f32<P>(cs + half + i, s);
        if constexpr (NEOX) {
            using V = taper::Pack<T, P>;
            const V a = *reinterpret_cast<const V*>(x + i);
            const V b = *reinterpret_cast<const V*>(x + half + i);
            V ya, yb;
#pragma unroll
            for (int j = 0; j < P; j++) {
                const float fa = taper::to_float(a.v[j]), fb = taper::to_float(b.v[j]);
                ya.v[j] = taper::from_float<T>(fa * c[j] - fb * s[j]);
                yb.v[j] = taper::from_float<T>(fb * c[j] + fa * s[j]);
            }
            *reinterpret_cast<V*>(x + i) = ya;
            *reinterpret_cast<V*>(x + half + i) = yb;
        } else {
            // The scalar path assumes only element alignment (D or the pointers may be odd).
            using V = taper::Pack<T, 2 * P, P == 1 ? sizeof(T) : 2 * P * sizeof(T)>;
            const V v = *reinterpret_cast<const V*>(x + 2 * i);
            V y;
#pragma unroll
            for (int j = 0; j < P; j++) {
                const float fa = taper::to_float(v.v[2 * j]), fb = taper::to_float(v.v[2 * j + 1]);
                y.v[2 * j] = taper::from_float<T>(fa * c[j] - fb * s[j]);
                y.v[2 * j + 1] = taper::from_float<T>(fb * c[j] + fa * s[j]);
            }
            *reinterpret_cast<V*>(x + 2 * i) = y;
        }
    }
}

// ---- launchers

template <typename T, int P, bool NEOX>
void launch_rotary(const int32_t* positions, void* q, void* k, const float* cache, int64_t T_,
                   int Hq, int Hkv, int D, int rot_dim, int64_t max_pos, cudaStream_t s) {
    // One thread per group up to 512 (Llama-3-8B bf16 neox: 40 heads x 8 groups = 320), so all
    // of a token's loads are in flight at once; multiples of 32 keep warps whole.
    const int64_t items = (int64_t)(Hq + Hkv) * (rot_dim / 2 / P);
    const int threads = items >= 512 ? 512 : (int)taper::ceil_div(items, 32) * 32;
    rotary_kernel<T, P, NEOX><<<(unsigned)T_, threads, 0, s>>>(
        positions, (T*)q, (T*)k, cache, Hq, Hkv, D, rot_dim, max_pos);
}

// The vector path when every pack and float4 it touches is 16-byte aligned: P pairs span 16
// bytes (neox: P elements at i and at i + half; interleaved: 2P elements at 2i), heads start on
// 16 bytes (D a multiple of the pack), and the cos/sin rows do too (half a multiple of P >= 4,
// or scalar cos/sin loads for f32 interleaved where P = 2).
template <typename T, bool NEOX>
void dispatch_rotary(const int32_t* positions, void* q, void* k, const float* cache, int64_t T_,
                     int Hq, int Hkv, int D, int rot_dim, int64_t max_pos, cudaStream_t s) {
    constexpr int P = NEOX ? 16 / sizeof(T) : 8 / sizeof(T);
    constexpr int pack = NEOX ? P : 2 * P;
    const int half = rot_dim / 2;
    if (half % P == 0 && D % pack == 0 && taper::aligned16(q) && taper::aligned16(k) && taper::aligned16(cache))
        launch_rotary<T, P, NEOX>(positions, q, k, cache, T_, Hq, Hkv, D, rot_dim, max_pos, s);
    else
        launch_rotary<T, 1, NEOX>(positions, q, k, cache, T_, Hq, Hkv, D, rot_dim, max_pos, s);
}

}  // namespace

extern "C" int taper_cuda_rotary_embedding(const int32_t* positions,    // (T,)
                                           void* q,                     // (T, Hq, D) dtype
                                           void* k,                     // (T, Hkv, D) dtype
                                           const float* cos_sin_cache,  // (max_pos, rot_dim)
                                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                           int64_t rot_dim, int64_t max_pos, int is_neox,
                                           int dtype, taper_stream_t stream) {
    if (T < 0 || Hq < 0 || Hkv < 0 || D <= 0 || max_pos < 0 || T > INT32_MAX ||
        Hq > INT32_MAX || Hkv > INT32_MAX || D > INT32_MAX || (Hq + Hkv) * D > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    if (rot_dim <= 0 || rot_dim % 2 || rot_dim > D) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || Hq + Hkv == 0) return TAPER_CUDA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        if (is_neox)
            dispatch_rotary<scalar_t, true>(positions, q, k, cos_sin_cache, T, (int)Hq, (int)Hkv,
                                            (int)D, (int)rot_dim, max_pos, s);
        else
            dispatch_rotary<scalar_t, false>(positions, q, k, cos_sin_cache, T, (int)Hq,
                                             (int)Hkv, (int)D, (int)rot_dim, max_pos, s);
    });
    return taper::launch_status();
}
