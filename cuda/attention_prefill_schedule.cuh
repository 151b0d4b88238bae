// The block schedule the FA2 and FA3 prefill kernels share (attention_prefill_fa2.cu describes
// it; tests/test_prefill_fa2_schedule.py replays it): a block serves one KV head and M "packed
// rows" (row = token * G + head in the group) of one sequence, found by a binary search over
// query_start_loc, and attends the keys from its first row's window start to its last row's
// position, in tiles of N aligned to multiples of N.
#pragma once

#include "common.cuh"

namespace taper {

struct PrefillBlock {
    int kvh;              // the KV head
    int64_t r0, r1;       // the packed rows [r0, r1)
    int64_t pos_off;      // token t sits at position t + pos_off
    const int32_t* bt;    // the sequence's block table
    int64_t k_lo, k_hi;   // the keys some row attends, [k_lo, k_hi] (inclusive)
    int64_t k_start;      // k_lo rounded down to a key tile
    int n_kv;             // key tiles from k_start
};

// Fills `s` for this block; false for a surplus tile (block-uniform: the caller returns before
// any barrier). Blocks are ordered KV head slowest and, within a head, the longest-context tiles
// first.
template <int M, int N>
__device__ __forceinline__ bool prefill_block(PrefillBlock& s,
                                              const int32_t* __restrict__ block_tables,
                                              const int32_t* __restrict__ seq_lens,
                                              const int32_t* __restrict__ query_start_loc,
                                              int64_t num_tokens, int B, int G, int Hkv, int BS,
                                              int MB, int64_t window) {
    const int64_t ntiles = gridDim.x / Hkv;
    s.kvh = (int)(blockIdx.x / ntiles);
    const int64_t tile = ntiles - 1 - blockIdx.x % ntiles;
    int b = 0;
    {
        int lo = 0, hi = B - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if ((int64_t)query_start_loc[mid] * G / M + mid <= tile) lo = mid;
            else hi = mid - 1;
        }
        b = lo;
    }
    const int64_t q_begin = query_start_loc[b], q_end_raw = query_start_loc[b + 1];
    const int64_t q_end = min(q_end_raw, num_tokens);
    const int64_t r0 = q_begin * G + (tile - (q_begin * G / M + b)) * M;
    if (r0 < 0 || r0 >= q_end * G) return false;
    const int64_t r1 = min(r0 + M, q_end * G);
    const int64_t pos_off = (int64_t)seq_lens[b] - q_end_raw;
    s.r0 = r0, s.r1 = r1, s.pos_off = pos_off;
    s.bt = block_tables + (int64_t)b * MB;

    // The block's keys: from its first row's window start to its last row's position.
    s.k_lo = window > 0 ? max((int64_t)0, r0 / G + pos_off - window + 1) : 0;
    s.k_hi = min((r1 - 1) / G + pos_off, (int64_t)MB * BS - 1);  // inclusive
    s.k_start = s.k_lo / N * N;
    s.n_kv = s.k_hi >= s.k_lo ? (int)((s.k_hi - s.k_start) / N + 1) : 0;
    return true;
}

}  // namespace taper
