// LoRA deltas with each row's adapter slot read on the device: Backend.lora_linear_slots
// (pyx/backend.pyx documents the op; pyx/lora_kernels.c, through lora_linear, is its CPU
// reference). The graph-safe form of lora_linear, as punica's BGMV: nothing about which rows run
// which adapter reaches the host, so a CUDA graph captured once replays any mix of adapters and
// base rows (engine/runner/cuda_graph.py writes the slots into a static buffer each step).
//
// Two kernels, each a no-op for a row of slot -1 (the base model) or past the slots:
// - shrink: y[t, j] = x[t] . a[s, j] for every j < P*R (the parts' A rows stacked), one warp per
//   (row, j) with 16-byte loads where the rows allow, float32 sums rounded to the activation
//   type, as the cuBLAS path rounds its shrink.
// - expand: out[t, c] += sum_j<R y[t, p*R + j] * b[s, j, c] for column c of part p, one thread
//   per column, the row's shrink staged in shared memory; out read, summed in float32, rounded
//   once. Every part runs at the slots' full rank R: a slot holds zeros past each part's rank
//   (engine/lora/slots.py), which add exactly nothing.
// The grid depends only on T, P*R and N, never on the slots.
#include "common.cuh"

namespace {

constexpr int SHRINK_WARPS = 8;       // y columns per block, one warp each
constexpr int EXPAND_THREADS = 256;   // output columns per block
constexpr int MAX_PARTS = 8;          // q, k, v of a fused projection need 3
constexpr int64_t MAX_SHARED_Y = 12288;   // floats of one row's shrink in shared memory (48 KiB)

struct Parts {
    int32_t start[MAX_PARTS + 1];   // part p is the columns [start[p], start[p + 1])
    int n;
};

// VEC: 8 elements per load (16 bytes of bf16/f16, two float4 of f32), where K is a multiple of 8
// and both rows start 16-byte aligned (the launcher checks); else one element at a time.
template <typename T, bool VEC>
__global__ void lora_shrink_kernel(const T* __restrict__ x,              // (T, K)
                                   const T* __restrict__ a,              // (S, PR, K)
                                   const int32_t* __restrict__ slot_of_row,  // (T,)
                                   T* __restrict__ y,                    // (T, PR)
                                   int64_t K, int64_t S, int PR) {
    const int64_t t = blockIdx.x;
    const int32_t s = slot_of_row[t];
    if (s < 0 || s >= S) return;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.y * SHRINK_WARPS + (threadIdx.x >> 5);
    if (j >= PR) return;
    const T* xr = x + t * K;
    const T* ar = a + ((int64_t)s * PR + j) * K;
    float acc = 0.f;
    if constexpr (VEC) {
        for (int64_t k = 8 * lane; k < K; k += 8 * 32) {
            float xv[8], av[8];
            taper::load8(xr + k, xv);
            taper::load8(ar + k, av);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc += xv[i] * av[i];
        }
    } else {
        for (int64_t k = lane; k < K; k += 32)
            acc += taper::to_float(xr[k]) * taper::to_float(ar[k]);
    }
    acc = taper::warp_sum(acc);
    if (lane == 0) y[t * PR + j] = taper::from_float<T>(acc);
}

template <typename T>
__global__ void lora_expand_kernel(const T* __restrict__ y,              // (T, PR)
                                   const T* __restrict__ b,              // (S, R, N)
                                   const int32_t* __restrict__ slot_of_row,  // (T,)
                                   T* __restrict__ out,                  // (T, N)
                                   int64_t N, int64_t S, int R, Parts parts) {
    extern __shared__ float ys[];   // (PR,): the row's shrink
    const int64_t t = blockIdx.x;
    const int32_t s = slot_of_row[t];
    if (s < 0 || s >= S) return;    // the whole block: before the barrier
    const int PR = parts.n * R;
    for (int i = threadIdx.x; i < PR; i += blockDim.x) ys[i] = taper::to_float(y[t * PR + i]);
    __syncthreads();
    const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= N) return;
    int p = 0;
    while (p + 1 < parts.n && c >= parts.start[p + 1]) ++p;
    const float* yp = ys + p * R;
    const T* bc = b + (int64_t)s * R * N + c;
    float acc = 0.f;
    for (int j = 0; j < R; ++j) acc += yp[j] * taper::to_float(bc[(int64_t)j * N]);
    T* o = out + t * N + c;
    *o = taper::from_float<T>(taper::to_float(*o) + acc);
}

template <typename T>
int launch_lora(const void* x, const void* a, const void* b, const int32_t* slot_of_row,
                const Parts& parts, void* y, void* out, int64_t T_, int64_t K, int64_t N,
                int64_t S, int64_t R, cudaStream_t stream) {
    const int PR = (int)(parts.n * R);
    const dim3 shrink_grid((unsigned)T_, (unsigned)taper::ceil_div(PR, SHRINK_WARPS));
    if (K % 8 == 0 && taper::aligned16(x) && taper::aligned16(a))
        lora_shrink_kernel<T, true><<<shrink_grid, SHRINK_WARPS * 32, 0, stream>>>(
            (const T*)x, (const T*)a, slot_of_row, (T*)y, K, S, PR);
    else
        lora_shrink_kernel<T, false><<<shrink_grid, SHRINK_WARPS * 32, 0, stream>>>(
            (const T*)x, (const T*)a, slot_of_row, (T*)y, K, S, PR);
    int st = taper::launch_status();
    if (st != TAPER_CUDA_OK) return st;
    const dim3 expand_grid((unsigned)T_, (unsigned)taper::ceil_div(N, EXPAND_THREADS));
    lora_expand_kernel<T><<<expand_grid, EXPAND_THREADS, PR * sizeof(float), stream>>>(
        (const T*)y, (const T*)b, slot_of_row, (T*)out, N, S, (int)R, parts);
    return taper::launch_status();
}

}  // namespace

extern "C" int taper_cuda_lora_linear_slots(const void* x,               // (T, K) dtype
                                            const void* a,               // (S, P*R, K) dtype
                                            const void* b,               // (S, R, N) dtype
                                            const int32_t* slot_of_row,  // (T,) device
                                            const int32_t* parts,        // (P+1,) host
                                            void* y,                     // (T, P*R) scratch
                                            void* out,                   // (T, N) dtype
                                            int64_t T, int64_t K, int64_t N, int64_t S,
                                            int64_t P, int64_t R, int dtype,
                                            taper_stream_t stream) {
    if (T < 0 || K < 0 || N < 0 || S < 0 || R < 0 || P < 1 || P > MAX_PARTS) {
        return TAPER_CUDA_ERR_ARG;
    }
    if (T > INT32_MAX || N > INT32_MAX || P * R > MAX_SHARED_Y) return TAPER_CUDA_ERR_ARG;
    if (!parts || parts[0] != 0 || parts[P] != N) return TAPER_CUDA_ERR_ARG;
    Parts pp = {};
    pp.n = (int)P;
    for (int64_t p = 0; p <= P; ++p) {
        if (p && parts[p] < parts[p - 1]) return TAPER_CUDA_ERR_ARG;
        pp.start[p] = parts[p];
    }
    if (T == 0 || N == 0 || R == 0 || S == 0) return TAPER_CUDA_OK;
    if (!x || !a || !b || !slot_of_row || !y || !out) return TAPER_CUDA_ERR_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        return launch_lora<scalar_t>(x, a, b, slot_of_row, pp, y, out, T, K, N, S, R, s);
    });
    return TAPER_CUDA_ERR_ARG;  // not reached: the dispatch returns in every case
}
