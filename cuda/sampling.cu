// Sampling on the device (logits float32, one row per sequence): greedy argmax, Gumbel-max
// sampling with the CPU backend's counter-based RNG, the sparse penalty update, and the
// temperature / top-k / top-p / min-p filter (engine/sampler.py's semantics, DESIGN.md section 5).
//
// The trick, for argmax and Gumbel-max: one block per row, each thread strides over the row keeping
// its best (value, index), and a block reduction keeps the larger value and, on ties, the lower
// index; that order is total, so the result is the serial scan's whatever the schedule. Gumbel
// draws are Philox4x32-10 counted by (v, position) under the row's seed, so every value equals the
// CPU's (up to the last ulp of the device `log`), and a thread skips Philox and both logs for a
// token whose logit plus the largest possible Gumbel draw cannot beat its best (exact).
//
// The trick, for the filter: every filter keeps the logits >= a per-row threshold, and each
// threshold is found by bisection over the order-preserving uint32 encoding of float32 (a key),
// one bit per pass from the top: top-k takes the largest key with count(key >= K) >= k, top-p the
// largest key with sum(exp(x - max), key >= K) >= top_p * sum(exp(x - max)), both as block
// reductions over the row (read from L2 after the first pass). Bits where the row's smallest and
// largest keys agree are decided without a pass. Counts are integers and the double sums use a
// fixed reduction tree, so the result is deterministic; the top-p threshold equals the CPU's
// (a cumulative sum over the candidates sorted descending, then searchsorted) up to the rounding
// of the different summation order, which can only matter when the mass of a prefix lands within
// a few ulps of top_p * Z.
//
// Semantics at the edges, the serial scans of pyx/cpu_kernels.c row_argmax:
// - argmax: NaN never wins; a NaN in column 0 gives 0 (the scan's first element sticks); an
//   all -inf row gives 0. (The CPU scans chunks of 8192 and a NaN at a chunk start hides that
//   chunk's other values; the device follows the one-chunk scan.)
// - Gumbel: -inf logits are skipped; if the first logit that is not -inf is NaN its index is
//   returned (the scan's first draw sticks), other NaNs never win; a row of all -inf gives 0.
// - filter: as NumPy's comparisons: NaN is never masked; the row max is NumPy's (NaN if any NaN)
//   replaced by 0 when not finite; np.partition orders NaN above +inf, so a k-th largest that is
//   NaN disables the masking of that row (the CPU's result is undefined there).
// Float arithmetic that NumPy does in separate steps uses the __f*_rn intrinsics, which nvcc never
// contracts into an FMA.
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kRowThreads = 1024;      // argmax, Gumbel and filter: one block per row
constexpr int kPenaltyThreads = 256;   // apply_penalties: one thread per entry

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// The largest Gumbel draw is -log(-log((2^32 - 0.5) / 2^32)) = 22.8737...; 22.88 bounds it with a
// margin far above the device log's 1-ulp error, so the skip test stays exact.
constexpr double kGumbelBound = 22.88;

constexpr uint32_t kNanKey = 0xFFFFFFFFu;  // every NaN: above +inf, as np.partition orders it

// ---- helpers

// Row loaders: the threshold searches and the argmax / Gumbel scan read a row through one of
// these, so the filter kernel (row in memory) and the fused sampler (temperature and mask applied
// on the fly, nothing written back) share them.
struct RawRow {  // the row as it is in memory
    const float* p;
    __device__ __forceinline__ float operator()(int v) const { return p[v]; }
};

struct ScaledRow {  // x / max(t, 1e-5) when t != 1, as filter_logits writes it back
    const float* p;
    float div;
    bool scale;
    __device__ __forceinline__ float operator()(int v) const {
        const float x = p[v];
        return scale ? __fdiv_rn(x, div) : x;
    }
};

struct MaskedRow {  // ScaledRow after filter_logits' masking pass: x + log(x >= thr)
    ScaledRow row;
    float thr;
    bool mask;
    __device__ __forceinline__ float operator()(int v) const {
        const float x = row(v);
        return mask ? __fadd_rn(x, x >= thr ? 0.f : -INFINITY) : x;
    }
};

// First word of Philox4x32-10 (Salmon et al. 2011) on counter (c0, c1, c2, c3), key (k0, k1):
// the CPU's philox10 with the 32x32->64 products split into lo (mul) and hi (__umulhi).
__device__ __forceinline__ uint32_t philox_x0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                              uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r) { k0 += kPhiloxW0; k1 += kPhiloxW1; }
        const uint32_t hi0 = __umulhi(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
        const uint32_t hi1 = __umulhi(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
        const uint32_t n0 = hi1 ^ c1 ^ k0;
        const uint32_t n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return c0;
}

// Order-preserving key of a float32: x < y <=> key(x) < key(y) for non-NaN x, y. -0 is mapped to
// +0 (they compare equal) and every NaN to kNanKey.
__device__ __forceinline__ uint32_t float_key(float x) {
    if (isnan(x)) return kNanKey;
    uint32_t b = __float_as_uint(x);
    if ((b << 1) == 0u) b = 0u;  // -0 -> +0, on the bits so no optimisation can drop it
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// np.maximum: NaN if either is NaN.
__device__ __forceinline__ float np_maximum(float a, float b) {
    if (isnan(a) || isnan(b)) return __int_as_float(0x7FC00000);
    return a > b ? a : b;
}

// (val, idx) is better than (bv, bi): a valid index, then the larger value, then the lower index.
// A total order, so the block result does not depend on the reduction's shape.
__device__ __forceinline__ void take_better(double& bv, int& bi, double val, int idx) {
    if (idx >= 0 && (bi < 0 || val > bv || (val == bv && idx < bi))) { bv = val; bi = idx; }
}

// Block reductions for blockDim.x == kRowThreads (32 warps); every thread gets the result. The
// butterfly leaves the same value in every lane (IEEE addition commutes), so the double sum is
// the same fixed tree on every run. The leading barrier protects `scratch` from the previous call.
enum class Reduce { Add, Min, Max };

template <Reduce R>
__device__ __forceinline__ uint32_t warp_reduce_u32(uint32_t v) {
    if constexpr (R == Reduce::Add) return __reduce_add_sync(0xffffffffu, v);
    if constexpr (R == Reduce::Min) return __reduce_min_sync(0xffffffffu, v);
    return __reduce_max_sync(0xffffffffu, v);
}

template <Reduce R>
__device__ __forceinline__ uint32_t block_reduce_u32(uint32_t v, uint32_t* scratch) {
    v = warp_reduce_u32<R>(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    return warp_reduce_u32<R>(scratch[threadIdx.x & 31]);
}

__device__ __forceinline__ uint32_t block_count(uint32_t v, uint32_t* scratch) {
    return block_reduce_u32<Reduce::Add>(v, scratch);
}
__device__ __forceinline__ uint32_t block_min_u32(uint32_t v, uint32_t* scratch) {
    return block_reduce_u32<Reduce::Min>(v, scratch);
}
__device__ __forceinline__ uint32_t block_max_u32(uint32_t v, uint32_t* scratch) {
    return block_reduce_u32<Reduce::Max>(v, scratch);
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    v = warp_sum_f64(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    return warp_sum_f64(scratch[threadIdx.x & 31]);
}

// Number of row elements with key >= c (NaN counts, as the largest key).
template <class Row>
__device__ __forceinline__ uint32_t count_key_ge(const Row& row, int n, uint32_t c,
                                                 uint32_t* scratch) {
    uint32_t cnt = 0;
    for (int v = threadIdx.x; v < n; v += kRowThreads) cnt += float_key(row(v)) >= c;
    return block_count(cnt, scratch);
}

// sum of expf(x - m) in double over the top-p set (x >= thr, so never NaN) with key(x) >= c. Each
// term is float32, as NumPy's np.exp(cand - rowmax) is, and is accumulated in double.
template <class Row>
__device__ __forceinline__ double mass_key_ge(const Row& row, int n, float thr, float m,
                                               uint32_t c, double* scratch) {
    double s = 0.0;
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        const float x = row(v);
        if (x >= thr && float_key(x) >= c) s += (double)expf(__fsub_rn(x, m));
    }
    return block_sum_f64(s, scratch);
}

// ---- radix select (taper_cuda_filter_logits_radix): the same thresholds as the bisection, the
// key decided 8 bits per pass (4 passes) instead of 1 (up to 32 passes)

constexpr int kBins = 256;

struct RadixScratch {
    unsigned long long hist[kBins];  // this pass's weight per digit, prefix-matching keys only
    unsigned long long above;        // weight of the keys above the current prefix's range
    uint32_t digit;
};

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The largest key K with W(K) >= target, W(K) = the weight of the row elements with key >= K in
// the set: for top-k (MASS false) every element weighs 1 (NaN included, the largest key) and
// target = k; for top-p (MASS true) the set is x >= thr and x weighs expf(x - m) in fixed point
// (m is the row's finite max, so each weight is in [0, 1]: times 2^fx_shift, truncated, with
// fx_shift chosen so n of them stay below 2^62) and target = p * W(0). Pass `shift` histograms
// digit (key >> shift) & 255 of the keys whose higher bits equal the prefix decided so far
// (warp-aggregated shared atomics: one atomic per distinct digit in a warp, integer, so the
// histogram is the same on every run); warp 0 then takes the largest digit whose suffix weight
// plus `above` reaches the target. W(0) >= target holds on entry (k <= n; p < 1), and each pass
// keeps it for the chosen digit's range, so a digit always exists and the result is a key present
// in the set: what the bisection over W(K) >= target finds, W computed in another arithmetic.
template <bool MASS, class Row>
__device__ uint32_t radix_select(const Row& row, int n, float thr, float m, double kval,
                                 RadixScratch* rs) {
    const int lane = threadIdx.x & 31;
    const int fx_shift = 62 - (32 - __clz((unsigned)n));  // n * 2^fx_shift <= 2^62
    uint32_t prefix = 0;
    unsigned long long above = 0;
    double target = kval;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int i = threadIdx.x; i < kBins; i += kRowThreads) rs->hist[i] = 0ull;
        __syncthreads();
        for (int64_t base = 0; base < n; base += kRowThreads) {  // whole warps: ballots below
            const int64_t v = base + threadIdx.x;
            bool in = false;
            uint32_t bin = 0;
            unsigned long long w = 1ull;
            if (v < n) {
                const float x = row((int)v);
                const uint32_t key = float_key(x);
                in = (key & hi_mask) == prefix;
                if (MASS) {
                    in = in && x >= thr;
                    if (in) w = __double2ull_rz(ldexp((double)expf(__fsub_rn(x, m)), fx_shift));
                }
                bin = (key >> shift) & 0xFFu;
            }
            unsigned todo = __ballot_sync(0xffffffffu, in);
            while (todo) {  // one atomic per distinct digit among the warp's elements
                const int leader = __ffs(todo) - 1;
                const uint32_t d = __shfl_sync(0xffffffffu, bin, leader);
                const bool mine = in && bin == d;
                const unsigned peers = __ballot_sync(0xffffffffu, mine);
                const unsigned long long sum =
                    MASS ? warp_sum_u64(mine ? w : 0ull) : (unsigned long long)__popc(peers);
                if (lane == leader) atomicAdd(&rs->hist[d], sum);
                todo &= ~peers;
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // lane l holds digits [8 l, 8 l + 8); suf = their weight plus every higher lane's
            unsigned long long t = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) t += rs->hist[8 * lane + j];
            unsigned long long suf = t;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long y = __shfl_down_sync(0xffffffffu, suf, o);
                if (lane + o < 32) suf += y;
            }
            if (MASS && shift == 24) target = kval * (double)__shfl_sync(0xffffffffu, suf, 0);
            // the lanes reaching the target are 0..L (suf shrinks with the lane); L's digits
            // are walked from the top
            const unsigned ok = __ballot_sync(0xffffffffu, (double)(above + suf) >= target);
            const int L = 31 - __clz(ok);
            if (lane == L) {
                unsigned long long run = above + suf - t;
                int d = 8 * L;
                for (int j = 7; j >= 0; j--) {
                    const unsigned long long h = rs->hist[8 * L + j];
                    if ((double)(run + h) >= target) {
                        d = 8 * L + j;
                        break;
                    }
                    run += h;
                }
                rs->digit = (uint32_t)d;
                rs->above = run;
            }
        }
        __syncthreads();
        prefix |= rs->digit << shift;
        above = rs->above;
        __syncthreads();  // every thread has read digit and above before the next pass's writes
    }
    return prefix;
}

// ---- row building blocks: the kernels below are compositions of these

// The row's argmax (GUMBEL false) or Gumbel-max sample with key `seed`, counter (v, pos)
// (GUMBEL true), read through `row`; the result is valid in thread 0. Every thread of the block
// must call it (block reductions).
template <bool GUMBEL, class Row>
__device__ int64_t row_best(const Row& row, int n, uint64_t seed, uint64_t pos) {
    __shared__ double s_val[32];
    __shared__ int s_idx[32];
    __shared__ uint32_t s_first[32];
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const uint32_t p0 = (uint32_t)pos, p1 = (uint32_t)(pos >> 32);

    double best = -INFINITY;
    int bi = -1;
    uint32_t first = 0xFFFFFFFFu;  // GUMBEL: this thread's first column whose logit is not -inf
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        const float x = row(v);
        if (!GUMBEL) {
            if (!isnan(x) && (bi < 0 || x > best)) { best = x; bi = v; }
        } else {
            if (x == -INFINITY) continue;
            if (first == 0xFFFFFFFFu) first = (uint32_t)v;
            if (isnan(x)) continue;
            // Rounding is monotone: x - g <= x + kGumbelBound, so this token cannot beat `best`
            // (ties go to the lower index, which `best` already has).
            if (bi >= 0 && (double)x + kGumbelBound <= best) continue;
            const uint32_t r = philox_x0((uint32_t)v, p0, p1, 0u, k0, k1);
            const double u = ((double)r + 0.5) * (1.0 / 4294967296.0);
            const double val = (double)x - log(-log(u));
            if (bi < 0 || val > best) { best = val; bi = v; }
        }
    }

    // Block reduction of (best, bi): butterfly in each warp, then warp 0 over the 32 partials.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        take_better(best, bi, __shfl_xor_sync(0xffffffffu, best, o),
                    __shfl_xor_sync(0xffffffffu, bi, o));
    if ((threadIdx.x & 31) == 0) { s_val[threadIdx.x >> 5] = best; s_idx[threadIdx.x >> 5] = bi; }
    if (GUMBEL) first = block_min_u32(first, s_first);  // its barriers order the stores above
    __syncthreads();
    int64_t r = 0;
    if (threadIdx.x < 32) {
        best = s_val[threadIdx.x];
        bi = s_idx[threadIdx.x];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            take_better(best, bi, __shfl_xor_sync(0xffffffffu, best, o),
                        __shfl_xor_sync(0xffffffffu, bi, o));
        r = bi < 0 ? 0 : bi;
        if (threadIdx.x == 0) {
            if (!GUMBEL && n > 0 && isnan(row(0))) r = 0;
            if (GUMBEL && first != 0xFFFFFFFFu && isnan(row((int)first))) r = first;
        }
    }
    return r;
}

// The row's smallest and largest keys, with and without NaN: filter_logits' first pass.
struct KeyRange {
    uint32_t kmin = kNanKey, kmax = 0, kmax_num = 0;

    __device__ __forceinline__ void add(float x) {
        const uint32_t key = float_key(x);
        kmin = min(kmin, key);
        kmax = max(kmax, key);
        if (key != kNanKey) kmax_num = max(kmax_num, key);
    }

    __device__ __forceinline__ void reduce(uint32_t* scratch) {
        kmin = block_min_u32(kmin, scratch);
        kmax = block_max_u32(kmax, scratch);
        kmax_num = block_max_u32(kmax_num, scratch);  // 0 (no float's key) when all are NaN
    }
};

// Shared memory of row_threshold.
struct ThresholdScratch {
    uint32_t u[32];
    double d[32];
    RadixScratch radix;
};

// The row's filter threshold (read through `row`, temperature already applied, keys range `kr`
// reduced): the largest of the top-k, top-p and min-p thresholds; -inf when none masks, NaN when
// the k-th largest is NaN. Callers mask only when thr > -inf, the CPU's thr > NEG_INF test, so a
// NaN threshold masks nothing. Every thread must call it with the same arguments (block
// reductions).
// RADIX: the thresholds by radix select (radix_select above) instead of bisection; a top-p row
// whose max is not finite, or that holds a NaN, still bisects (its weights would not be in
// [0, 1]).
template <bool RADIX, class Row>
__device__ float row_threshold(const Row& row, int n, const KeyRange& kr, int32_t k, float p,
                               float mp, ThresholdScratch* s) {
    const bool use_k = k > 0 && k < n;
    const bool use_p = p < 1.f;
    const bool use_m = mp > 0.f;
    const uint32_t kmin = kr.kmin, kmax = kr.kmax, kmax_num = kr.kmax_num;

    // x.max(axis=1) propagates NaN; the sampler replaces a non-finite max (NaN, +-inf) by 0.
    const float maxnum = key_float(kmax_num);
    const float m = (kmax == kNanKey || !isfinite(maxnum)) ? 0.f : maxnum;

    float thr = -INFINITY;
    if (use_k) {
        // The largest key K with count(key >= K) >= k: the k-th largest, ties counted. Candidates
        // <= kmin count all V >= k elements, those > kmax none, so those bits need no pass. The
        // branch conditions are the same in every thread, so the reductions are reached by all.
        uint32_t K = 0;
        if (RADIX) {
            K = radix_select<false>(row, n, -INFINITY, 0.f, (double)k, &s->radix);
        } else {
            for (int bit = 31; bit >= 0; bit--) {
                const uint32_t c = K | (1u << bit);
                bool ok;
                if (c <= kmin) ok = true;
                else if (c > kmax) ok = false;
                else ok = count_key_ge(row, n, c, s->u) >= (uint32_t)k;
                if (ok) K = c;
            }
        }
        thr = key_float(K);  // NaN when the k-th largest is NaN: no masking, as thr > -inf fails
    }
    if (RADIX && use_p && !isnan(thr) && kmax != kNanKey && isfinite(maxnum) && p > 0.f) {
        // m is the row's max, so every weight expf(x - m) of the set is in [0, 1]
        thr = np_maximum(thr, key_float(radix_select<true>(row, n, thr, m, (double)p,
                                                           &s->radix)));
    } else if (use_p && !isnan(thr) && kmax_num != 0) {
        // The set: x >= thr (all non-NaN values without top-k), its keys in [lo, kmax_num]. The
        // threshold is the largest key K <= kmax_num with S(K) = mass(key >= K) >= top_p * Z: the
        // CPU's cand[searchsorted(cum, top_p * Z)], the whole tie group of that value counted, and
        // the set's max when top_p * Z <= 0. For K <= lo, S(K) is Z itself (the same terms in the
        // same order), so those bits need no pass. When Z >= top_p * Z fails (only 0 * inf = NaN),
        // the CPU clamps to the set's smallest value, which moves no threshold: thr stays.
        const uint32_t lo = max(kmin, float_key(thr));
        const double Z = mass_key_ge(row, n, thr, m, 0u, s->d);
        const double target = (double)p * Z;
        if (Z >= target) {
            uint32_t K = 0;
            for (int bit = 31; bit >= 0; bit--) {
                const uint32_t c = K | (1u << bit);
                bool ok;
                if (c <= lo) ok = true;
                else if (c > kmax_num) ok = false;
                else ok = mass_key_ge(row, n, thr, m, c, s->d) >= target;
                if (ok) K = c;
            }
            thr = np_maximum(thr, key_float(K));
        }
    }
    if (use_m) {
        // min-p: prob < min_p * max prob <=> logit < max + log(min_p), log in double then float32.
        thr = np_maximum(thr, __fadd_rn(m, (float)log((double)mp)));
    }
    return thr;
}

// The penalty update of one entry (vLLM's order), shared by apply_penalties and the fused sampler.
__device__ __forceinline__ void apply_penalty(float* p, float bias, float rep, float pres_freq) {
    float x = __fadd_rn(*p, bias);
    if (rep != 1.f) x = x > 0.f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    *p = __fsub_rn(x, pres_freq);
}

// ---- kernels

// One block per row: out[b] = the row's argmax, or its Gumbel-max sample with key seeds[b] and
// counter (v, positions[b]). GUMBEL is a template flag so argmax carries no Philox code.
template <bool GUMBEL>
__global__ void __launch_bounds__(kRowThreads)
row_argmax_kernel(const float* __restrict__ logits,       // (B, V)
                  const uint64_t* __restrict__ seeds,     // (B,), GUMBEL only
                  const int64_t* __restrict__ positions,  // (B,), GUMBEL only
                  int64_t* __restrict__ out,              // (B,)
                  int64_t V) {
    const int64_t b = blockIdx.x;
    const RawRow row{logits + b * V};
    const uint64_t seed = GUMBEL ? seeds[b] : 0, pos = GUMBEL ? (uint64_t)positions[b] : 0;
    const int64_t r = row_best<GUMBEL>(row, (int)V, seed, pos);
    if (threadIdx.x == 0) out[b] = r;
}

// One thread per entry; the N (row, col) pairs are distinct, so no two threads touch one logit.
__global__ void apply_penalties_kernel(float* __restrict__ logits,          // (B, V)
                                       const int32_t* __restrict__ rows,    // (N,)
                                       const int32_t* __restrict__ cols,    // (N,)
                                       const float* __restrict__ bias,      // (N,)
                                       const float* __restrict__ rep,       // (N,)
                                       const float* __restrict__ pres_freq, // (N,)
                                       int64_t B, int64_t V, int64_t N) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const int64_t r = rows[i], c = cols[i];
    if (r < 0 || r >= B || c < 0 || c >= V) return;  // a bad entry is dropped, never written
    apply_penalty(logits + r * V + c, bias[i], rep[i], pres_freq[i]);
}

// One block per row, in place: temperature, then the top-k / top-p / min-p threshold, then the
// masking pass. Every thread reads back only the columns it wrote in the temperature pass until
// the block reductions' barriers, so the in-place update needs no extra barrier.
// Launch bounds (1024, 1): under the default 2-blocks-per-SM target ptxas caps the kernel at 32
// registers and spills around the expf of the top-p passes; 38 registers and one block of 32 warps
// per SM keep it spill-free, and 32 warps still keep enough L2 loads in flight.
template <bool RADIX>
__global__ void __launch_bounds__(kRowThreads, 1)
filter_logits_kernel(float* __restrict__ logits,             // (B, V)
                     const float* __restrict__ temperature,  // (B,)
                     const int32_t* __restrict__ top_k,      // (B,)
                     const float* __restrict__ top_p,        // (B,)
                     const float* __restrict__ min_p,        // (B,)
                     int64_t V) {
    __shared__ ThresholdScratch s;
    const int64_t b = blockIdx.x;
    float* row = logits + b * V;
    const int n = (int)V;

    const float t = temperature[b];
    const int32_t k = top_k[b];
    const float p = top_p[b], mp = min_p[b];
    const bool scale = t != 1.f;
    const float div = t < 1e-5f ? 1e-5f : t;  // np.maximum(t, 1e-5): a NaN t stays NaN

    // Pass 1: temperature, and the row's smallest and largest keys (with and without NaN).
    KeyRange kr;
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        float x = row[v];
        if (scale) { x = __fdiv_rn(x, div); row[v] = x; }
        kr.add(x);
    }
    if (!((k > 0 && k < n) || p < 1.f || mp > 0.f)) return;
    kr.reduce(s.u);
    const float thr = row_threshold<RADIX>(RawRow{row}, n, kr, k, p, mp, &s);
    if (!(thr > -INFINITY)) return;
    // x += log(x >= thr), as the CPU's _mask_below does: 0 keeps x, -inf drops it, NaN stays NaN.
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        const float x = row[v];
        row[v] = __fadd_rn(x, x >= thr ? 0.f : -INFINITY);
    }
}

// The whole sampler for one row per block (TAPER_CUDA_FUSED_SAMPLING=1): this row's penalty
// entries, then for a greedy row the argmax, for the others temperature, the filter threshold
// (radix select) and the Gumbel-max draw over the kept tokens. Exactly apply_penalties, then
// argmax or filter_logits_radix and gumbel_sample: the same arithmetic on the same values, but
// temperature and the mask are applied as the row is read instead of written back, so the row
// is read once from memory (the first pass) and then from L2, and written only at the penalty
// entries. Passes over the row: 1 for greedy or unfiltered rows; with filters 1 (key range)
// + 4 (top-k) + 4 (top-p) + 1 (the draw), each present only when its filter is.
// Penalty entries are sorted by row (engine/sampler.py's penalty_entries), so a block finds its
// own by binary search; the columns are distinct within a row, and the barrier after the update
// makes the writes visible to the whole block before the row is read.
__global__ void __launch_bounds__(kRowThreads, 1)
sample_fused_kernel(float* __restrict__ logits,               // (B, V), penalised in place
                    const uint8_t* __restrict__ greedy,       // (B,)
                    const float* __restrict__ temperature,    // (B,)
                    const int32_t* __restrict__ top_k,        // (B,)
                    const float* __restrict__ top_p,          // (B,)
                    const float* __restrict__ min_p,          // (B,)
                    const uint64_t* __restrict__ seeds,       // (B,)
                    const int64_t* __restrict__ positions,    // (B,)
                    const int32_t* __restrict__ pen_rows,     // (N,) sorted
                    const int32_t* __restrict__ pen_cols,     // (N,)
                    const float* __restrict__ pen_bias,       // (N,)
                    const float* __restrict__ pen_rep,        // (N,)
                    const float* __restrict__ pen_pres_freq,  // (N,)
                    int64_t* __restrict__ out,                // (B,)
                    int64_t V, int64_t N) {
    __shared__ ThresholdScratch s;
    __shared__ int64_t s_range[2];
    const int64_t b = blockIdx.x;
    float* row = logits + b * V;
    const int n = (int)V;

    if (N > 0) {
        if (threadIdx.x < 2) {  // lower_bound(pen_rows, b + threadIdx.x)
            const int64_t want = b + threadIdx.x;
            int64_t lo = 0, hi = N;
            while (lo < hi) {
                const int64_t mid = (lo + hi) >> 1;
                if (pen_rows[mid] < want) lo = mid + 1; else hi = mid;
            }
            s_range[threadIdx.x] = lo;
        }
        __syncthreads();
        for (int64_t i = s_range[0] + threadIdx.x; i < s_range[1]; i += kRowThreads) {
            const int64_t c = pen_cols[i];
            if (c >= 0 && c < V) apply_penalty(row + c, pen_bias[i], pen_rep[i], pen_pres_freq[i]);
        }
        __syncthreads();
    }

    int64_t r;
    if (greedy[b]) {
        r = row_best<false>(RawRow{row}, n, 0, 0);
    } else {
        const float t = temperature[b];
        const int32_t k = top_k[b];
        const float p = top_p[b], mp = min_p[b];
        const ScaledRow scaled{row, t < 1e-5f ? 1e-5f : t, t != 1.f};
        float thr = -INFINITY;
        if ((k > 0 && k < n) || p < 1.f || mp > 0.f) {
            KeyRange kr;
            for (int v = threadIdx.x; v < n; v += kRowThreads) kr.add(scaled(v));
            kr.reduce(s.u);
            thr = row_threshold<true>(scaled, n, kr, k, p, mp, &s);
        }
        const MaskedRow kept{scaled, thr, thr > -INFINITY};
        r = row_best<true>(kept, n, seeds[b], (uint64_t)positions[b]);
    }
    if (threadIdx.x == 0) out[b] = r;
}

// Shared argument check for the row kernels: one block per row (B fits the grid) and int columns.
int check_rows(int64_t B, int64_t V) {
    if (B < 0 || V < 0 || B > INT32_MAX || V > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    return TAPER_CUDA_OK;
}

}  // namespace

// ---- launchers

extern "C" int taper_cuda_argmax(const float* logits,  // (B, V)
                                 int64_t* out,         // (B,)
                                 int64_t B, int64_t V, taper_stream_t stream) {
    if (check_rows(B, V)) return TAPER_CUDA_ERR_ARG;
    if (B == 0) return TAPER_CUDA_OK;
    if (!out || (V > 0 && !logits)) return TAPER_CUDA_ERR_ARG;
    // 1024 threads per row: a batch-1 row of 150k logits is one block, so it uses the widest block
    // to cover the row in about 150 coalesced loads per thread.
    row_argmax_kernel<false><<<(unsigned)B, kRowThreads, 0, (cudaStream_t)stream>>>(
        logits, nullptr, nullptr, out, V);
    return taper::launch_status();
}

extern "C" int taper_cuda_gumbel_sample(const float* logits,       // (B, V)
                                        const uint64_t* seeds,     // (B,)
                                        const int64_t* positions,  // (B,)
                                        int64_t* out,              // (B,)
                                        int64_t B, int64_t V, taper_stream_t stream) {
    if (check_rows(B, V)) return TAPER_CUDA_ERR_ARG;
    if (B == 0) return TAPER_CUDA_OK;
    if (!out || !seeds || !positions || (V > 0 && !logits)) return TAPER_CUDA_ERR_ARG;
    // 1024 threads per row, as argmax: the double-precision logs of the Gumbel draws are the
    // cost, and the widest block spreads them over all of an SM's FP64 units.
    row_argmax_kernel<true><<<(unsigned)B, kRowThreads, 0, (cudaStream_t)stream>>>(
        logits, seeds, positions, out, V);
    return taper::launch_status();
}

extern "C" int taper_cuda_apply_penalties(float* logits,          // (B, V)
                                          const int32_t* rows,    // (N,)
                                          const int32_t* cols,    // (N,)
                                          const float* bias,      // (N,)
                                          const float* rep,       // (N,)
                                          const float* pres_freq, // (N,)
                                          int64_t B, int64_t V, int64_t N,
                                          taper_stream_t stream) {
    if (B < 0 || V < 0 || N < 0) return TAPER_CUDA_ERR_ARG;
    if (N == 0 || B == 0 || V == 0) return TAPER_CUDA_OK;
    if (!logits || !rows || !cols || !bias || !rep || !pres_freq) return TAPER_CUDA_ERR_ARG;
    const int64_t grid = taper::ceil_div(N, kPenaltyThreads);
    if (grid > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    // 256 threads per block: one scattered load and store per thread, no reuse, any size works.
    apply_penalties_kernel<<<(unsigned)grid, kPenaltyThreads, 0, (cudaStream_t)stream>>>(
        logits, rows, cols, bias, rep, pres_freq, B, V, N);
    return taper::launch_status();
}

// The two filters' entry points: kRadix picks the threshold search (bisection or radix select).
template <bool kRadix>
static int launch_filter_logits(float* logits, const float* temperature, const int32_t* top_k,
                                const float* top_p, const float* min_p, int64_t B, int64_t V,
                                taper_stream_t stream) {
    if (check_rows(B, V)) return TAPER_CUDA_ERR_ARG;
    if (B == 0 || V == 0) return TAPER_CUDA_OK;
    if (!logits || !temperature || !top_k || !top_p || !min_p) return TAPER_CUDA_ERR_ARG;
    // 1024 threads per row: the passes re-read the row (600 KB at V = 150k, resident in L2 after
    // the first pass; the radix select makes 4 per threshold), and the widest block keeps the
    // most loads in flight on one SM.
    filter_logits_kernel<kRadix><<<(unsigned)B, kRowThreads, 0, (cudaStream_t)stream>>>(
        logits, temperature, top_k, top_p, min_p, V);
    return taper::launch_status();
}

extern "C" int taper_cuda_filter_logits(float* logits,             // (B, V)
                                        const float* temperature,  // (B,)
                                        const int32_t* top_k,      // (B,)
                                        const float* top_p,        // (B,)
                                        const float* min_p,        // (B,)
                                        int64_t B, int64_t V, taper_stream_t stream) {
    return launch_filter_logits<false>(logits, temperature, top_k, top_p, min_p, B, V, stream);
}

extern "C" int taper_cuda_filter_logits_radix(float* logits,             // (B, V)
                                              const float* temperature,  // (B,)
                                              const int32_t* top_k,      // (B,)
                                              const float* top_p,        // (B,)
                                              const float* min_p,        // (B,)
                                              int64_t B, int64_t V, taper_stream_t stream) {
    return launch_filter_logits<true>(logits, temperature, top_k, top_p, min_p, B, V, stream);
}

extern "C" int taper_cuda_sample_fused(float* logits,                // (B, V)
                                       const uint8_t* greedy,        // (B,)
                                       const float* temperature,     // (B,)
                                       const int32_t* top_k,         // (B,)
                                       const float* top_p,           // (B,)
                                       const float* min_p,           // (B,)
                                       const uint64_t* seeds,        // (B,)
                                       const int64_t* positions,     // (B,)
                                       const int32_t* pen_rows,      // (N,)
                                       const int32_t* pen_cols,      // (N,)
                                       const float* pen_bias,        // (N,)
                                       const float* pen_rep,         // (N,)
                                       const float* pen_pres_freq,   // (N,)
                                       int64_t* out,                 // (B,)
                                       int64_t B, int64_t V, int64_t N, taper_stream_t stream) {
    if (check_rows(B, V) || N < 0) return TAPER_CUDA_ERR_ARG;
    if (B == 0) return TAPER_CUDA_OK;
    if (V == 0 || !logits || !greedy || !temperature || !top_k || !top_p || !min_p || !seeds ||
        !positions || !out)
        return TAPER_CUDA_ERR_ARG;
    if (N > 0 && (!pen_rows || !pen_cols || !pen_bias || !pen_rep || !pen_pres_freq))
        return TAPER_CUDA_ERR_ARG;
    // 1024 threads per row, as the filter: up to 10 passes over the row, all but the first from
    // L2, and the widest block keeps the most loads in flight on one SM.
    sample_fused_kernel<<<(unsigned)B, kRowThreads, 0, (cudaStream_t)stream>>>(
        logits, greedy, temperature, top_k, top_p, min_p, seeds, positions, pen_rows, pen_cols,
        pen_bias, pen_rep, pen_pres_freq, out, V, N);
    return taper::launch_status();
}
