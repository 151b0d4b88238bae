"""The schedule of the FA2 prefill kernel (cuda/attention_prefill_fa2.cu), replayed on the CPU.

Without a GPU the kernel itself cannot run here (tests/gpu/test_cuda_prefill_fa2.py runs it), but
its index arithmetic can: which block owns which packed rows (token x query head of one KV head,
found by the binary search over floor(qsl[b] G / 64) + b), which key tiles a block loads, which a
warp skips, and which it leaves unmasked. `replay` follows those decisions exactly, with the
mathematics in float64 NumPy, and the CPU backend's paged attention (pyx/cpu_kernels.c) is the
reference. A schedule that dropped a row, skipped a tile some row needs, or left a tile unmasked
that straddles a row's causal or window edge fails here; the control test shows that leaving every
tile unmasked does change the answer on these batches. The same schedule runs in the Hopper kernel
(cuda/attention_prefill_fa3.cu, kernels prefill=fa3) with one difference, replayed with
warp_skips=False: its four warps issue the warpgroup's wgmmas together, so no warp skips a tile
(a tile none of a warp's rows attends is masked whole) and an idle warp's rows mask everything.
"""
from __future__ import annotations

import numpy as np
import pytest

M = N = 64        # packed query rows per block, keys per tile (FA_M, FA_N)
WARP_ROWS = 16    # rows per warp (one mma M)


def replay(q, kc, vc, tables, seq_lens, qsl, scale, window, softcap, mask_all_edges=True,
           warp_skips=True):
    """The kernel's output (float64) and how many times each (token, head) row was written."""
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = kc.shape
    B, MB = tables.shape
    G = Hq // Hkv
    out = np.zeros((T, Hq, D))
    writes = np.zeros((T, Hq), int)
    ntiles = T * G // M + B
    starts = qsl[:B].astype(np.int64) * G // M + np.arange(B)  # sequence b's first tile
    for kvh in range(Hkv):
        for tile in range(ntiles):
            b = int(np.searchsorted(starts, tile, side="right")) - 1
            q_begin, q_end_raw = int(qsl[b]), int(qsl[b + 1])
            q_end = min(q_end_raw, T)
            r0 = q_begin * G + (tile - int(starts[b])) * M
            if r0 >= q_end * G:
                continue  # a surplus tile
            r1 = min(r0 + M, q_end * G)
            pos_off = int(seq_lens[b]) - q_end_raw
            k_lo = max(0, r0 // G + pos_off - window + 1) if window else 0
            k_hi = min((r1 - 1) // G + pos_off, MB * BS - 1)
            k_start = k_lo // N * N
            n_kv = (k_hi - k_start) // N + 1 if k_hi >= k_lo else 0
            for w in range(M // WARP_ROWS):
                w_r0 = r0 + w * WARP_ROWS
                if w_r0 >= r1 and warp_skips:
                    continue
                active = w_r0 < r1
                w_r_last = min(w_r0 + WARP_ROWS - 1, r1 - 1)
                w_p_min, w_p_max = w_r0 // G + pos_off, w_r_last // G + pos_off
                w_k_min = w_p_min - window + 1 if window else 0
                w_k_max = min(w_p_max, k_hi)
                w_all_lo = w_p_max - window + 1 if window else 0
                w_all_hi = min(w_p_min, k_hi)
                rows = np.arange(w_r0, w_r0 + WARP_ROWS)
                ok = rows < r1
                tok, head = rows // G, kvh * G + rows % G
                p = tok + pos_off
                hi = np.minimum(p, k_hi)
                lo = p - window + 1 if window else np.zeros_like(p)
                qr = np.zeros((WARP_ROWS, D))
                qr[ok] = q[tok[ok], head[ok]]
                m = np.full(WARP_ROWS, -np.inf)
                lsum = np.zeros(WARP_ROWS)
                o = np.zeros((WARP_ROWS, D))
                for it in range(n_kv):
                    kt = k_start + it * N
                    if warp_skips and (kt > w_k_max or kt + N - 1 < w_k_min):
                        continue  # no row of the warp attends this tile (fa2)
                    j = kt + np.arange(N)
                    blk = np.full(N, -1)
                    inside = (j >= k_lo) & (j <= k_hi)
                    blk[inside] = tables[b, j[inside] // BS]
                    valid = inside & (blk >= 0) & (blk < NB)
                    kt_rows, vt_rows = np.zeros((N, D)), np.zeros((N, D))  # zero-filled copies
                    kt_rows[valid] = kc[blk[valid], j[valid] % BS, kvh]
                    vt_rows[valid] = vc[blk[valid], j[valid] % BS, kvh]
                    s = qr @ kt_rows.T * scale
                    if softcap:
                        s = softcap * np.tanh(s / softcap)
                    full = active and kt >= w_all_lo and kt + N - 1 <= w_all_hi
                    if mask_all_edges and not full:
                        keep = ok[:, None] & (j[None] >= lo[:, None]) & (j[None] <= hi[:, None])
                        s = np.where(keep, s, -np.inf)
                    m_new = np.maximum(m, s.max(axis=1))
                    base = np.where(m_new == -np.inf, 0.0, m_new)
                    alpha = np.exp(m - base)
                    pr = np.exp(s - base[:, None])
                    lsum = lsum * alpha + pr.sum(axis=1)
                    o = o * alpha[:, None] + pr @ vt_rows
                    m = m_new
                inv = np.where(lsum > 0, 1.0 / np.where(lsum > 0, lsum, 1.0), 0.0)
                out[tok[ok], head[ok]] = o[ok] * inv[ok, None]
                np.add.at(writes, (tok[ok], head[ok]), 1)
    return out, writes


def paged(rng, seqs, BS, Hq, Hkv, D):
    """A paged batch: (seq_len, q_len) per sequence, blocks in a random order, large finite
    garbage in slots and blocks no sequence owns, tables padded with a garbage block."""
    nblocks = [-(-s // BS) for s, _ in seqs]
    NB = sum(nblocks) + 3
    ids = rng.permutation(NB).astype(np.int32)
    MB = max(nblocks) + 2
    tables = np.full((len(seqs), MB), ids[-1], np.int32)
    used = 0
    for b in range(len(seqs)):
        tables[b, :nblocks[b]] = ids[used:used + nblocks[b]]
        used += nblocks[b]
    kc = (rng.standard_normal((NB, BS, Hkv, D)) * 30).astype(np.float32)
    vc = (rng.standard_normal((NB, BS, Hkv, D)) * 30).astype(np.float32)
    for b, (s, _) in enumerate(seqs):
        j = np.arange(s)
        kc[tables[b, j // BS], j % BS] = rng.standard_normal((s, Hkv, D))
        vc[tables[b, j // BS], j % BS] = rng.standard_normal((s, Hkv, D))
    qsl = np.concatenate([[0], np.cumsum([ql for _, ql in seqs])]).astype(np.int32)
    q = (rng.standard_normal((int(qsl[-1]), Hq, D)) * 3).astype(np.float32)
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    return q, kc, vc, tables, seq_lens, qsl


def cpu_reference(q, kc, vc, tables, seq_lens, qsl, scale, window, softcap):
    from pyx.cpu_backend import CpuBackend
    out = np.full(q.shape, np.nan, np.float32)
    CpuBackend().paged_attention(out, q, kc, vc, tables, seq_lens, qsl, scale, window,
                                 softcap=softcap)
    return out


SEQS = [(300, 300), (500, 77), (129, 1), (64, 64), (1000, 130), (33, 17), (1, 1), (65, 65),
        (257, 3)]
# (Hq, Hkv, BS, window, softcap): groups 1, 2, 3, 4, 5, 8 and multi-query; blocks that divide
# the 64-key tile and blocks that do not; no window, a window of 1 (the diagonal alone), windows
# shorter and longer than a tile; soft-cap on and off
CASES = [(2, 2, 16, 0, 0.0), (4, 2, 32, 100, 0.0), (6, 2, 24, 37, 3.0), (8, 2, 16, 0, 0.0),
         (8, 2, 16, 100, 0.0), (10, 2, 48, 1, 0.0), (16, 2, 128, 0, 5.0), (32, 1, 16, 37, 0.0)]


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("Hq,Hkv,BS,window,softcap", CASES)
def test_schedule_matches_cpu_attention(Hq, Hkv, BS, window, softcap, kernel):
    rng = np.random.default_rng(Hq * 100 + BS + window)
    D = 16  # the schedule does not depend on D; small keeps the replay fast
    batch = paged(rng, SEQS, BS, Hq, Hkv, D)
    scale = 1 / np.sqrt(D)
    got, writes = replay(*batch, scale, window, softcap, warp_skips=kernel == "fa2")
    assert (writes == 1).all(), f"rows written {writes.min()}..{writes.max()} times, not once"
    want = cpu_reference(*batch, scale, window, softcap)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, f"schedule replay vs CPU attention: max relative error {err:.3g}"


@pytest.mark.parametrize("warp_skips", [True, False])
@pytest.mark.parametrize("window", [0, 100])
def test_unmasked_edges_change_the_answer(window, warp_skips):
    """The control: the replay without the masking of straddling tiles is wrong on the same
    batches, so the test above sees the masking decisions."""
    rng = np.random.default_rng(window)
    batch = paged(rng, SEQS, 16, 8, 2, 16)
    scale = 0.25
    got, _ = replay(*batch, scale, window, 0.0, mask_all_edges=False, warp_skips=warp_skips)
    want = cpu_reference(*batch, scale, window, 0.0)
    assert np.abs(got - want).max() / np.abs(want).max() > 0.1
