// Sampling on the device (logits float32, one row per sequence): greedy argmax, Gumbel-max
// sampling with the CPU backend's counter-based RNG, the sparse penalty update, and the
// temperature / top-k / top-p / min-p filter (engine/sampling/sampler.py's semantics, DESIGN.md section 5).
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
// The trick, for the fused sampler (sample_fused_kernel, kernels sampling=fused): the ops
// above in one launch, the filtered row read from memory once; a histogram of that pass bounds
// the final threshold from below, so a second pass (from L2) leaves only the few tokens above
// the bound, in shared memory, for the radix selects and the draw.
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
// on the fly, nothing written back; or its candidates in shared memory) share them. row(i) is
// the value at position i, row.index(i) its token id; kPositional: position i is token i.
struct RawRow {  // the row as it is in memory
    static constexpr bool kPositional = true;
    const float* p;
    __device__ __forceinline__ float operator()(int v) const { return p[v]; }
    __device__ __forceinline__ int index(int v) const { return v; }
};

struct ScaledRow {  // x / max(t, 1e-5) when t != 1, as filter_logits writes it back
    static constexpr bool kPositional = true;
    const float* p;
    float div;
    bool scale;
    __device__ __forceinline__ float operator()(int v) const {
        const float x = p[v];
        return scale ? __fdiv_rn(x, div) : x;
    }
    __device__ __forceinline__ int index(int v) const { return v; }
};

struct Candidates {  // the fused sampler's compacted (scaled value, token) pairs, any order
    static constexpr bool kPositional = false;
    const float* val;
    const int* idx;
    __device__ __forceinline__ float operator()(int i) const { return val[i]; }
    __device__ __forceinline__ int index(int i) const { return idx[i]; }
};

template <class Row>
struct Masked {  // Row after filter_logits' masking pass: x + log(x >= thr)
    static constexpr bool kPositional = Row::kPositional;
    Row row;
    float thr;
    bool mask;
    __device__ __forceinline__ float operator()(int v) const {
        const float x = row(v);
        return mask ? __fadd_rn(x, x >= thr ? 0.f : -INFINITY) : x;
    }
    __device__ __forceinline__ int index(int v) const { return row.index(v); }
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

// ---- radix select (the fused sampler's thresholds): the same thresholds as the bisection, the
// key decided 8 bits per pass (4 passes) instead of 1 (up to 32 passes). As a filter of its own
// it lost to the bisection (H200, 2026-11-28, B=64, V=128256: 648 us against 570 us), so
// filter_logits bisects; the fused sampler (kernels sampling=fused) finds its thresholds with
// it, on its candidates in shared memory and in its fallback over the whole row.

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

// The top-p weight of x: expf(x - m) (in [0, 1] for x <= m) times 2^fx_shift, truncated. With
// fx_shift = fixed_point_shift(V), V of them stay below 2^62, so sums of them are exact integers
// whatever their order.
__device__ __forceinline__ int fixed_point_shift(int V) {
    return 62 - (32 - __clz((unsigned)V));  // V * 2^fx_shift <= 2^62
}
__device__ __forceinline__ unsigned long long mass_weight(float x, float m, int fx_shift) {
    return __double2ull_rz(ldexp((double)expf(__fsub_rn(x, m)), fx_shift));
}

// hist[bin] += w for this warp's lanes with `in` (integer, so the histogram is the same on every
// run): one shared atomic per distinct bin among them. Every lane of the warp must call it.
// MASS false: every weight is 1 (the lanes are counted). T: uint32 counts or uint64 weights.
template <bool MASS, class T>
__device__ __forceinline__ void warp_hist_add(T* hist, bool in, uint32_t bin,
                                              unsigned long long w) {
    const int lane = threadIdx.x & 31;
    unsigned todo = __ballot_sync(0xffffffffu, in);
    while (todo) {
        const int leader = __ffs(todo) - 1;
        const uint32_t d = __shfl_sync(0xffffffffu, bin, leader);
        const bool mine = in && bin == d;
        const unsigned peers = __ballot_sync(0xffffffffu, mine);
        const unsigned long long sum =
            MASS ? warp_sum_u64(mine ? w : 0ull) : (unsigned long long)__popc(peers);
        if (lane == leader) atomicAdd(&hist[d], (T)sum);
        todo &= ~peers;
    }
}

// Run by warp 0 on a finished histogram: the largest digit d whose weight at or above it plus
// `above` (the weight above the histogram's range) reaches `target`; writes d and the weight
// strictly above d's bin (plus `above`) to rs. Lane l holds digits [8 l, 8 l + 8); suf = their
// weight plus every higher lane's. The lanes reaching the target are 0..L (suf shrinks with the
// lane); L's digits are walked from the top. from_total: target becomes kval times the
// histogram's total weight (top-p's W(0)), or times `total` when that is given (nonzero).
__device__ __forceinline__ void warp_pick_digit(RadixScratch* rs, unsigned long long above,
                                                double& target, bool from_total, double kval,
                                                unsigned long long total) {
    const int lane = threadIdx.x & 31;
    unsigned long long t = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) t += rs->hist[8 * lane + j];
    unsigned long long suf = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_down_sync(0xffffffffu, suf, o);
        if (lane + o < 32) suf += y;
    }
    if (from_total)
        target = kval * (double)(total ? total : __shfl_sync(0xffffffffu, suf, 0));
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

// The largest key K with W(K) >= target, W(K) = the weight of the row elements with key >= K in
// the set: for top-k (MASS false) every element weighs 1 (NaN included, the largest key) and
// target = k; for top-p (MASS true) the set is x >= thr and x weighs mass_weight(x, m, fx_shift)
// (m is the row's finite max, so each weight is in [0, 1]; fx_shift = fixed_point_shift(V)) and
// target = p * W(0), W(0) summed here unless `total` gives it (0: not given). Pass `shift`
// histograms digit (key >> shift) & 255 of the keys whose higher bits equal the prefix decided
// so far; warp 0 then takes the largest digit whose suffix weight plus `above` reaches the
// target. W(0) >= target holds on entry (k <= n; p < 1), and each pass keeps it for the chosen
// digit's range, so a digit always exists and the result is a key present in the set: what the
// bisection over W(K) >= target finds, W computed in another arithmetic. The integer weights make
// the result independent of the order of the row's elements, so `row` may be any arrangement of
// a superset of the keys >= the answer (the fused sampler's candidates) as long as `total` is
// the whole set's W(0) there.
template <bool MASS, class Row>
__device__ uint32_t radix_select(const Row& row, int n, float thr, float m, double kval,
                                 int fx_shift, unsigned long long total, RadixScratch* rs) {
    uint32_t prefix = 0;
    unsigned long long above = 0;
    double target = kval;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int i = threadIdx.x; i < kBins; i += kRowThreads) rs->hist[i] = 0ull;
        __syncthreads();
        for (int64_t base = 0; base < n; base += kRowThreads) {  // whole warps: ballots inside
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
                    if (in) w = mass_weight(x, m, fx_shift);
                }
                bin = (key >> shift) & 0xFFu;
            }
            warp_hist_add<MASS>(rs->hist, in, bin, w);
        }
        __syncthreads();
        if (threadIdx.x < 32)
            warp_pick_digit(rs, above, target, MASS && shift == 24, kval, total);
        __syncthreads();
        prefix |= rs->digit << shift;
        above = rs->above;
        __syncthreads();  // every thread has read digit and above before the next pass's writes
    }
    return prefix;
}

// ---- row building blocks: the kernels below are compositions of these

// The row's argmax (GUMBEL false) or Gumbel-max sample with key `seed`, counter (token, pos)
// (GUMBEL true), read through `row` (n positions); the token is valid in thread 0. Every thread
// of the block must call it (block reductions). The order (value, then the lower token) is
// total, so the answer does not depend on how tokens are spread over positions or threads. The
// NaN rules below (a NaN at token 0 for argmax, a NaN first non -inf token for Gumbel) need
// positional rows; the fused sampler's candidates never hold a NaN.
template <bool GUMBEL, class Row>
__device__ int64_t row_best(const Row& row, int n, uint64_t seed, uint64_t pos) {
    __shared__ double s_val[32];
    __shared__ int s_idx[32];
    __shared__ uint32_t s_first[32];
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const uint32_t p0 = (uint32_t)pos, p1 = (uint32_t)(pos >> 32);

    double best = -INFINITY;
    int bi = -1;
    uint32_t first = 0xFFFFFFFFu;  // GUMBEL: this thread's first token whose logit is not -inf
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        const float x = row(v);
        const int idx = row.index(v);
        if (!GUMBEL) {
            if (!isnan(x)) take_better(best, bi, x, idx);
        } else {
            if (x == -INFINITY) continue;
            first = min(first, (uint32_t)idx);
            if (isnan(x)) continue;
            // x - g <= x + 22.8737... < x + kGumbelBound <= best: this token cannot reach
            // `best`, whatever the tie order (exact, rounding is monotone).
            if (bi >= 0 && (double)x + kGumbelBound <= best) continue;
            const uint32_t r = philox_x0((uint32_t)idx, p0, p1, 0u, k0, k1);
            const double u = ((double)r + 0.5) * (1.0 / 4294967296.0);
            take_better(best, bi, (double)x - log(-log(u)), idx);
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
        if constexpr (Row::kPositional) {
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
// RADIX: the thresholds by radix select (radix_select above) instead of bisection, as the fused
// sampler finds them on its candidates (its fallback over the whole row uses this, so that both
// of its paths agree); a top-p row whose max is not finite, or that holds a NaN, still bisects
// (its weights would not be in [0, 1]). filter_logits bisects.
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
            K = radix_select<false>(row, n, -INFINITY, 0.f, (double)k, 0, 0ull, &s->radix);
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
                                                           fixed_point_shift(n), 0ull,
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
    const float thr = row_threshold<false>(RawRow{row}, n, kr, k, p, mp, &s);
    if (!(thr > -INFINITY)) return;
    // x += log(x >= thr), as the CPU's _mask_below does: 0 keeps x, -inf drops it, NaN stays NaN.
    for (int v = threadIdx.x; v < n; v += kRowThreads) {
        const float x = row[v];
        row[v] = __fadd_rn(x, x >= thr ? 0.f : -INFINITY);
    }
}

// ---- the fused sampler (kernels sampling=fused)

// Shared-memory candidates per row: 32 KB of (value, token) pairs. A top-k of up to a few
// thousand, or a min-p / top-p cut on a peaked row, fits; a row whose bound lets more through
// falls back to the filter's passes over the whole row.
constexpr int kMaxCandidates = 4096;
// Pass 1's histogram: the top 12 bits of the key (sign, exponent, 3 mantissa bits), so a bin
// spans an eighth of a binade; 4 bins per thread.
constexpr int kFineShift = 20;
constexpr int kFineBins = 4096;
constexpr int kBinsPerThread = kFineBins / kRowThreads;
// Slack for the top-p bound: it must hold against expf's, float subtraction's and the fixed
// point's rounding (each ~1e-5 relative or less), so it keeps 0.1 % of the budget unused.
constexpr double kTopPBoundSlack = 1e-3;

struct FusedScratch {
    ThresholdScratch t;
    union {
        uint32_t fine_hist[kFineBins];  // pass 1
        struct {                        // pass 2 on: (scaled value, token), any order
            float val[kMaxCandidates];
            int idx[kMaxCandidates];
        } cand;
    };
    unsigned long long sum[32];
    double dsum[32];
    uint32_t count;
    int64_t range[2];
};

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v,
                                                            unsigned long long* scratch) {
    v = warp_sum_u64(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    return warp_sum_u64(scratch[threadIdx.x & 31]);
}

// Sum of v over the block's threads before this one (thread order; a fixed tree, so a double
// sum is the same on every run). For blockDim.x == kRowThreads.
template <class T>
__device__ __forceinline__ T block_prefix_excl(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = T(0);
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    T before = T(0);
    for (int w = 0; w < warp; w++) before += scratch[w];
    return before + excl;
}

// From pass 1's histogram of the top 12 key bits (`h`: this thread's kBinsPerThread bins, from
// bin kBinsPerThread * threadIdx.x), a key every token below which the final threshold drops
// (0: none known). Every thread must call it (block reductions); all get the result.
// - top-k: the start of the bin holding the k-th largest key (the largest bin whose count at or
//   above it reaches k; all n tokens are counted, n > k);
// - top-p without top-k: the start of the largest bin d whose mass below, bounded above by
//   count x exp(the bin's largest value - m) per bin, is at most (1 - p) times a lower bound of
//   the total mass (count x exp(smallest - m) per bin, and at least the max's weight 1), less
//   kTopPBoundSlack. Then W(d) >= p W(0) in the radix select's fixed point, so its threshold is
//   >= the bin start;
// - min-p without top-p: the min-p threshold itself.
// The top-p set (x >= the top-k threshold) must lie whole above the bound unless its total is
// summed separately, so with top-p the min-p bound is not used, and with top-k neither is the
// top-p one.
__device__ uint32_t fine_bound(const uint32_t (&h)[kBinsPerThread], int n, bool use_k, int32_t k,
                               bool use_p, float p, bool use_m, float min_p_thr, float m,
                               FusedScratch* s) {
    const int first_bin = kBinsPerThread * threadIdx.x;
    uint32_t best = 0;  // 1 + the largest qualifying bin, 0 for none
    if (use_k) {
        uint32_t c = 0;
#pragma unroll
        for (int j = 0; j < kBinsPerThread; j++) c += h[j];
        uint32_t below = block_prefix_excl<uint32_t>(c, s->t.u);
#pragma unroll
        for (int j = 0; j < kBinsPerThread; j++) {
            if ((uint32_t)n - below >= (uint32_t)k) best = first_bin + j + 1;  // count at/above
            below += h[j];
        }
    } else if (use_p) {
        double up[kBinsPerThread], lo = 0.0, u = 0.0;
#pragma unroll
        for (int j = 0; j < kBinsPerThread; j++) {
            const uint32_t b0 = (uint32_t)(first_bin + j) << kFineShift;
            const uint32_t b1 = b0 + ((1u << kFineShift) - 1u);
            // The bin's smallest and largest values (x <= m). Keys below -inf's and above +inf's
            // are NaN patterns no token has (float_key maps NaN to kNanKey, and this row holds
            // none): -inf's bin (7) holds no other value, the bins below it and the top ones
            // nothing.
            float vlo = key_float(b0), vhi = key_float(b1);
            if (isnan(vlo)) vlo = -INFINITY;
            if (isnan(vhi)) vhi = b0 < 0x80000000u ? -INFINITY : m;
            vhi = fminf(vhi, m);
            up[j] = h[j] ? (double)h[j] * exp((double)vhi - (double)m) : 0.0;
            if (h[j]) lo += (double)h[j] * exp((double)vlo - (double)m);
            u += up[j];
        }
        const double z_lo = fmax(block_sum_f64(lo, s->t.d), 1.0);
        const double budget = (1.0 - (double)p) * z_lo * (1.0 - kTopPBoundSlack);
        double below = block_prefix_excl<double>(u, s->dsum);
#pragma unroll
        for (int j = 0; j < kBinsPerThread; j++) {
            if (below <= budget) best = first_bin + j + 1;
            below += up[j];
        }
    }
    uint32_t lb = use_k || use_p ? (block_max_u32(best, s->t.u) - 1u) << kFineShift : 0u;
    if (use_m && !use_p) lb = max(lb, float_key(min_p_thr));
    return lb;
}

// The whole sampler for one row per block: this row's penalty entries, then for a greedy row the
// argmax, for the others temperature, the top-k / top-p / min-p threshold and the Gumbel-max
// draw over the kept tokens. The same token as apply_penalties, then argmax or filter_logits
// and gumbel_sample, with temperature and the mask applied as the row is read instead of
// written back, except that the thresholds come from radix selects (row_threshold<true>):
// top-k's is the same, top-p's mass is summed in fixed point instead of double (see
// taper_cuda.h).
//
// Passes over a filtered row: (1) from memory, the key range and a histogram of the keys' top 12
// bits, which bound the final threshold from below (fine_bound); (2) from L2, the tokens at or
// above the bound are compacted into shared memory (and, for top-p without top-k, the total mass
// summed). The thresholds and the draw then run on the candidates alone. Everything that decides
// a result there is an integer (counts, fixed-point masses) or a total order (value, then
// token), so the candidates' order, set by shared atomics, changes nothing; and every token
// below the bound is one the full filter drops. A row with a NaN or a non-finite max, a
// top-p <= 0, or more candidates than fit, runs the filter's passes over the whole row instead
// (up to 4 + 4), then one for the draw. Unfiltered rows: one pass (the draw); greedy rows: one
// (the argmax).
// Penalty entries are sorted by row (engine/sampling/sampler.py's penalty_entries), so a block finds its
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
    __shared__ FusedScratch s;
    const int64_t b = blockIdx.x;
    float* row = logits + b * V;
    const int n = (int)V;
    const int lane = threadIdx.x & 31;

    if (N > 0) {
        if (threadIdx.x < 2) {  // lower_bound(pen_rows, b + threadIdx.x)
            const int64_t want = b + threadIdx.x;
            int64_t lo = 0, hi = N;
            while (lo < hi) {
                const int64_t mid = (lo + hi) >> 1;
                if (pen_rows[mid] < want) lo = mid + 1; else hi = mid;
            }
            s.range[threadIdx.x] = lo;
        }
        __syncthreads();
        for (int64_t i = s.range[0] + threadIdx.x; i < s.range[1]; i += kRowThreads) {
            const int64_t c = pen_cols[i];
            if (c >= 0 && c < V) apply_penalty(row + c, pen_bias[i], pen_rep[i], pen_pres_freq[i]);
        }
        __syncthreads();
    }

    if (greedy[b]) {
        const int64_t r = row_best<false>(RawRow{row}, n, 0, 0);
        if (threadIdx.x == 0) out[b] = r;
        return;
    }
    const float t = temperature[b];
    const int32_t k = top_k[b];
    const float p = top_p[b], mp = min_p[b];
    const uint64_t seed = seeds[b], pos = (uint64_t)positions[b];
    const ScaledRow scaled{row, t < 1e-5f ? 1e-5f : t, t != 1.f};
    const bool use_k = k > 0 && k < n, use_p = p < 1.f, use_m = mp > 0.f;
    if (!(use_k || use_p || use_m)) {
        const int64_t r = row_best<true>(scaled, n, seed, pos);
        if (threadIdx.x == 0) out[b] = r;
        return;
    }

    // Pass 1, from memory: the key range and the top 12 bits' histogram.
#pragma unroll
    for (int j = 0; j < kBinsPerThread; j++) s.fine_hist[kBinsPerThread * threadIdx.x + j] = 0u;
    __syncthreads();
    KeyRange kr;
    for (int64_t base = 0; base < n; base += kRowThreads) {  // whole warps: ballots inside
        const int64_t v = base + threadIdx.x;
        uint32_t bin = 0;
        if (v < n) {
            const float x = scaled((int)v);
            kr.add(x);
            bin = float_key(x) >> kFineShift;
        }
        warp_hist_add<false>(s.fine_hist, v < n, bin, 1ull);
    }
    kr.reduce(s.t.u);  // its barriers also complete the histogram
    const float maxnum = key_float(kr.kmax_num);
    const float m = (kr.kmax == kNanKey || !isfinite(maxnum)) ? 0.f : maxnum;
    const float min_p_thr = use_m ? __fadd_rn(m, (float)log((double)mp)) : -INFINITY;
    bool compact = kr.kmax != kNanKey && isfinite(maxnum) && (!use_p || p > 0.f);

    // Pass 2, from L2: the candidates (key >= lb), and top-p's total mass when they may not
    // hold the whole top-p set (no top-k).
    const int fx_shift = fixed_point_shift(n);
    unsigned long long total = 0;
    uint32_t C = 0;
    if (compact) {
        uint32_t h[kBinsPerThread];
#pragma unroll
        for (int j = 0; j < kBinsPerThread; j++)
            h[j] = s.fine_hist[kBinsPerThread * threadIdx.x + j];
        const uint32_t lb = fine_bound(h, n, use_k, k, use_p, p, use_m, min_p_thr, m, &s);
        const bool need_total = use_p && !use_k;
        if (threadIdx.x == 0) s.count = 0;
        __syncthreads();  // the histogram is read and count is 0 before any candidate is stored
        for (int64_t base = 0; base < n; base += kRowThreads) {
            const int64_t v = base + threadIdx.x;
            float x = 0.f;
            bool in = false;
            if (v < n) {
                x = scaled((int)v);
                in = float_key(x) >= lb;
                if (need_total) total += mass_weight(x, m, fx_shift);  // the set: every token
            }
            const unsigned ballot = __ballot_sync(0xffffffffu, in);
            uint32_t slot = 0;
            if (lane == 0 && ballot) slot = atomicAdd(&s.count, (uint32_t)__popc(ballot));
            slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(ballot & ((1u << lane) - 1u));
            if (in && slot < (uint32_t)kMaxCandidates) {
                s.cand.val[slot] = x;
                s.cand.idx[slot] = (int)v;
            }
        }
        if (need_total) total = block_sum_u64(total, s.sum);
        __syncthreads();
        C = s.count;
        compact = C <= (uint32_t)kMaxCandidates;
    }

    int64_t r;
    if (compact) {
        const Candidates cand{s.cand.val, s.cand.idx};
        float thr = -INFINITY;
        // k > C only when the min-p bound lies above the k-th largest, which then drops nothing
        if (use_k && (uint32_t)k <= C)
            thr = key_float(radix_select<false>(cand, (int)C, -INFINITY, 0.f, (double)k, 0, 0ull,
                                                &s.t.radix));
        if (use_p)
            thr = np_maximum(thr, key_float(radix_select<true>(cand, (int)C, thr, m, (double)p,
                                                               fx_shift, total, &s.t.radix)));
        if (use_m) thr = np_maximum(thr, min_p_thr);
        r = row_best<true>(Masked<Candidates>{cand, thr, thr > -INFINITY}, (int)C, seed, pos);
    } else {
        const float thr = row_threshold<true>(scaled, n, kr, k, p, mp, &s.t);
        r = row_best<true>(Masked<ScaledRow>{scaled, thr, thr > -INFINITY}, n, seed, pos);
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

extern "C" int taper_cuda_filter_logits(float* logits,             // (B, V)
                                        const float* temperature,  // (B,)
                                        const int32_t* top_k,      // (B,)
                                        const float* top_p,        // (B,)
                                        const float* min_p,        // (B,)
                                        int64_t B, int64_t V, taper_stream_t stream) {
    if (check_rows(B, V)) return TAPER_CUDA_ERR_ARG;
    if (B == 0 || V == 0) return TAPER_CUDA_OK;
    if (!logits || !temperature || !top_k || !top_p || !min_p) return TAPER_CUDA_ERR_ARG;
    // 1024 threads per row: the passes re-read the row (600 KB at V = 150k, resident in L2 after
    // the first pass), and the widest block keeps the most loads in flight on one SM.
    filter_logits_kernel<<<(unsigned)B, kRowThreads, 0, (cudaStream_t)stream>>>(
        logits, temperature, top_k, top_p, min_p, V);
    return taper::launch_status();
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
