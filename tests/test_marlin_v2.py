"""cuda/marlin.cu variant 2 (Marlin v2) emulated on the CPU, lane by lane: the striped plan
(stripes of k-tiles running across column slices), the XOR-swizzled A tile read back through
ldmatrix.x4's lane-to-row mapping, the lop3 magic-number dequantization bit for bit in f16 and
bf16, the 4-stage ring, and the flush of each column segment (straight out, or a float partial
in the workspace summed in block order by the last block to arrive, in a random arrival order).

The reference is the dequantized weight (pyx.weights.marlin.unpack_marlin, equal bit for bit to
Int4Weight.dequantize, itself checked against the checkpoint formats' own packers) rounded as
the kernel's B operand, times x. With the swizzle left out of the reads, the same emulation
no longer matches it (the test can fail). The layout is variant 0's and 1's: no repack.
"""
import numpy as np
import pytest

from pyx.weights.marlin import canonical, repack_int4
from test_marlin import CASES, _bf16_round, _round16, mma_16816

V2_KT, V2_NB, V2_STAGES, V2_BLOCKS_PER_SM = 64, 4, 4, 2
THREADS = 32 * V2_NB


def v2_plan(M, N, K, sms):
    """v2_plan of cuda/marlin.cu: (mb, gx, gy, iters, workspace bytes)."""
    mb = 1 if M <= 16 else 2
    ncols, KT = -(-(-(-N // 64)) // V2_NB), K // V2_KT
    total, gy = ncols * KT, -(-M // (16 * mb))
    slots = sms * V2_BLOCKS_PER_SM
    iters = KT
    if gy * ncols < slots:
        min_iters = min(KT, V2_STAGES if mb == 1 else 2 * V2_STAGES)
        iters = max(-(-total // -(-slots // gy)), min_iters)
    gx = -(-total // iters)
    ws = 0
    if gx > 1 and iters % KT:
        ws = -(-gy * ncols * 4 // 256) * 256 + gy * gx * 2 * mb * 16 * V2_NB * 64 * 4
    return mb, gx, gy, iters, ws


def lop3_and_or(a, b, c):
    return (a & np.uint32(b)) | np.uint32(c)


def v2_dequant(word, s, z, dtype):
    """DequantV2<T>::dequant for 32 lanes: word (32,) uint32, the scales and zeros of blocks
    2j, 2j + 1 ((32,) float32 each) -> B registers [blk 0/1][h][lane][e] as float32."""
    s, z = [np.asarray(v, np.float32) for v in s], [np.asarray(v, np.float32) for v in z]
    if dtype == "f16":
        w8 = word >> np.uint32(8)
        u = [lop3_and_or(word, 0x000F000F, 0x64006400), lop3_and_or(word, 0x00F000F0, 0x64006400),
             lop3_and_or(w8, 0x000F000F, 0x64006400), lop3_and_or(w8, 0x00F000F0, 0x64006400)]
        h = [np.stack([v & np.uint32(0xFFFF), v >> np.uint32(16)], -1).astype(np.uint16)
             .view(np.float16) for v in u]
        out = np.zeros((2, 2, 32, 2), np.float32)
        for blk in range(2):
            sc = s[blk].astype(np.float16)[:, None]
            lo = np.float32(1024) + z[blk]
            hi = np.float32(-64) - z[blk]
            even = h[2 * blk] - lo.astype(np.float16)[:, None]                    # exact
            odd = (h[2 * blk + 1].astype(np.float32) * np.float32(1 / 16)         # one fma, exact
                   + hi[:, None]).astype(np.float16)
            out[blk, 0] = (even * sc).astype(np.float32)
            out[blk, 1] = (odd * sc).astype(np.float32)
        return out
    out = np.zeros((2, 2, 32, 2), np.float32)
    for p in range(4):
        u = lop3_and_or(word >> np.uint32(4 * p), 0x000F000F, 0x43004300)
        h = (np.stack([u & np.uint32(0xFFFF), u >> np.uint32(16)], -1) << np.uint32(16)).view(
            np.float32)                                                            # 128 + code
        blk = p // 2
        d = _bf16_round(_bf16_round(h - np.float32(128)) - _bf16_round(z[blk])[:, None])
        out[blk, p % 2] = _bf16_round(d * _bf16_round(s[blk])[:, None])
    return out


def ldmatrix_x4(phys, addr_row, addr_col):
    """ldmatrix.sync.m8n8.x4.b16: lane l gives the row address (addr_row[l], addr_col[l]) of
    row l % 8 of matrix l // 8; thread T gets, of each matrix q, row T // 4, elements
    2 (T % 4), 2 (T % 4) + 1 -> (4, 32, 2)."""
    T = np.arange(32)
    src = 8 * np.arange(4)[:, None] + T // 4                                       # (4, 32)
    col = addr_col[src] + 2 * (T % 4)
    return np.stack([phys[addr_row[src], col], phys[addr_row[src], col + 1]], -1)


def emulate_v2(x, m, dtype, sms=132, arrival_seed=0, read_swizzle=True):
    """Variant 2 block by block in a random order. Returns (out, the B weight as rounded,
    counters, plan)."""
    M, K = x.shape
    N, np_, G = m.n, m.n_padded, m.group_size
    mb, gx, gy, iters, ws = v2_plan(M, N, K, sms)
    ntiles, KT = np_ // 64, K // V2_KT
    ncols = -(-ntiles // V2_NB)
    total, TF = ncols * KT, mb * 16 * V2_NB * 64
    codes, scales, zeros = canonical(m)
    zfull = np.full(scales.shape, 8.0, np.float32) if zeros is None else zeros.astype(np.float32)
    s16 = _round16(np.repeat(scales, G, 1), dtype)
    w_eff = _round16(s16 * (codes.astype(np.float32) - np.repeat(zfull, G, 1)), dtype)
    qw4, sc = m.qweight.reshape(-1, 4), m.scales.reshape(-1)
    zf = None if m.zeros is None else m.zeros.reshape(-1)
    counters = np.zeros(gy * ncols, np.int64)
    partials = np.full(gy * gx * 2 * TF, np.nan, np.float32)
    out = np.full((M, N), np.nan)
    lane = np.arange(32)
    c, t = lane >> 2, lane & 3
    reg_idx = ((np.arange(mb)[:, None, None] * 8 + np.arange(8)[:, None]) * 4
               + np.arange(4))[None, ..., None] * THREADS + (
        np.arange(V2_NB)[:, None, None, None, None] * 32 + lane)         # (warp, mi, b, e, lane)
    blocks = [(bx, by) for by in range(gy) for bx in range(gx)]
    np.random.default_rng(arrival_seed).shuffle(blocks)
    for bx, by in blocks:
        m0, start = by * mb * 16, bx * iters
        n = min(start + iters, total) - start
        assert n > 0
        first_col = start // KT
        ring = [None] * V2_STAGES

        def load(st, idx):
            col, kt = divmod(idx, KT)
            nt0, k0 = col * V2_NB, kt * V2_KT
            phys = np.full((mb * 16, V2_KT), np.nan)
            for r in range(mb * 16):
                for ch in range(8):
                    v = x[m0 + r, k0 + ch * 8:k0 + ch * 8 + 8] if m0 + r < M else 0.0
                    phys[r, (ch ^ (r & 7)) * 8:(ch ^ (r & 7)) * 8 + 8] = v
            sB = np.zeros((4 * V2_NB * 32, 4), np.uint32)
            for i in range(4 * V2_NB * 32):
                ks, rem = divmod(i, V2_NB * 32)
                if nt0 + rem // 32 < ntiles:
                    sB[i] = qw4[((kt * 4 + ks) * ntiles + nt0) * 32 + rem]
            gofs = (k0 // G) * np_ + nt0 * 64
            sS = np.full(V2_NB * 64, np.nan, np.float32)
            sZ = np.full(V2_NB * 64, 255, np.uint8)
            for i in range(V2_NB * 16):
                if nt0 + i // 16 < ntiles:
                    sS[4 * i:4 * i + 4] = sc[gofs + 4 * i:gofs + 4 * i + 4]
            if zf is not None:
                for i in range(V2_NB * 4):
                    if nt0 + i // 4 < ntiles:
                        sZ[16 * i:16 * i + 16] = zf[gofs + 16 * i:gofs + 16 * i + 16]
            ring[st] = (phys, sB, sS, sZ, idx)

        acc = np.zeros((V2_NB, mb, 8, 4, 32))
        for st in range(V2_STAGES - 1):
            if st < n:
                load(st, start + st)
        for i in range(n):
            if i + V2_STAGES - 1 < n:
                load((i + V2_STAGES - 1) % V2_STAGES, start + i + V2_STAGES - 1)
            phys, sB, sS, sZ, idx = ring[i % V2_STAGES]
            assert idx == start + i
            col, kt = divmod(idx, KT)
            for warp in range(V2_NB):
                nt = col * V2_NB + warp
                if nt >= ntiles:
                    continue
                at = warp * 64 + 8 * c[:, None] + np.arange(8)
                s = sS[at]
                zz = np.full((32, 8), 8.0, np.float32) if zf is None else sZ[at].astype(np.float32)
                for ks in range(4):
                    q = sB[(ks * V2_NB + warp) * 32 + lane]
                    breg = np.zeros((8, 2, 32, 2))
                    for j in range(4):
                        breg[2 * j:2 * j + 2] = v2_dequant(q[:, j], (s[:, 2 * j], s[:, 2 * j + 1]),
                                                           (zz[:, 2 * j], zz[:, 2 * j + 1]), dtype)
                    for blk in range(8):
                        n_idx = nt * 64 + blk * 8 + c
                        live = n_idx < N
                        for h in range(2):
                            for e in range(2):
                                kk = kt * 64 + ks * 16 + 2 * t + 8 * h + e
                                np.testing.assert_array_equal(breg[blk, h, live, e],
                                                              w_eff[n_idx[live], kk[live]])
                    for mi in range(mb):
                        row = mi * 16 + (lane & 15)
                        chunk = ks * 2 + (lane >> 4)
                        pc = (chunk ^ (row & 7)) if read_swizzle else chunk
                        a = ldmatrix_x4(phys, row, pc * 8)
                        for blk in range(8):
                            acc[warp, mi, blk] += mma_16816(a, breg[blk])
            if kt != KT - 1 and i != n - 1:
                continue
            acc32 = acc.astype(np.float32)
            b_first, b_last = col * KT // iters, ((col + 1) * KT - 1) // iters
            write = True
            if b_first != b_last:
                which = 0 if col == first_col else 1
                base = (by * gx * 2 + bx * 2 + which) * TF
                rows = (m0 + np.arange(mb)[:, None, None, None] * 16
                        + (np.arange(4)[:, None] >> 1) * 8 + c)  # (mi, 1, e, lane)
                live = np.broadcast_to(rows < M, reg_idx.shape)
                partials[(base + reg_idx)[live]] = acc32[live]   # rows past M stay NaN
                counters[by * ncols + col] += 1
                write = counters[by * ncols + col] == b_last - b_first + 1
                if write:
                    counters[by * ncols + col] = 0
                    total_acc = np.zeros_like(acc32)
                    for bb in range(b_first, b_last + 1):
                        w = 0 if bb * iters // KT == col else 1
                        slot = (by * gx * 2 + bb * 2 + w) * TF
                        total_acc += acc32 if bb == bx else partials[slot + reg_idx]
                    acc32 = total_acc
            if write:
                for warp in range(V2_NB):
                    nt = col * V2_NB + warp
                    if nt >= ntiles:
                        continue
                    for mi in range(mb):
                        r0 = m0 + mi * 16 + c
                        for blk in range(8):
                            cn = nt * 64 + blk * 8 + 2 * t
                            for e in range(2):
                                for rows, reg in ((r0, e), (r0 + 8, 2 + e)):
                                    sel = (rows < M) & (cn + e < N)
                                    assert np.isnan(out[rows[sel], cn[sel] + e]).all()
                                    out[rows[sel], cn[sel] + e] = acc32[warp, mi, blk, reg, sel]
            acc[:] = 0
    return out, w_eff, counters, (mb, gx, gy, iters, ws)


def test_plan_stripes_small_m_and_whole_columns_at_large_m():
    """Llama-3-8B's o projection on 132 SMs: M = 1 cuts 16 columns x 64 k-tiles into 256 stripes
    of 4 (shared columns, a workspace); M = 1024 gives 32 chunks x 16 columns, whole columns."""
    mb, gx, gy, iters, ws = v2_plan(1, 4096, 4096, 132)
    assert (mb, gx, gy, iters) == (1, 256, 1, 4) and ws > 0
    mb, gx, gy, iters, ws = v2_plan(1024, 4096, 4096, 132)
    assert (mb, gx, gy, iters, ws) == (2, 16, 32, 64, 0)
    # gate_up at M = 1: 112 columns x 64 k-tiles over 264 slots: stripes of 28 cross columns
    mb, gx, gy, iters, ws = v2_plan(1, 28672, 4096, 132)
    assert iters == 28 and gx == 256 and ws > 0


@pytest.mark.parametrize("case,M,n,k,dtype,sms", [
    ("awq-g128", 5, 136, 1024, "f16", 4),          # 3 n-tiles (one slice, a missing warp)
    ("ct-sym-channel", 1, 520, 512, "bf16", 3),     # per channel, zeros None, 3 slices
    ("gptq-v1-asym-g64", 16, 296, 640, "bf16", 3),  # zero 16, a stripe across 2 slices
    ("ct-asym-group", 40, 264, 1024, "f16", 4),     # 32-row chunks, 2 slices, shared
    ("gptq-sym-g128", 33, 72, 128, "f16", 64),      # chunks fill the GPU: whole columns
    ("ct-sym-group", 1, 1280, 512, "bf16", 4),      # stripes of 5 over 5 slices of 8 k-tiles
])
def test_device_gemm_v2_emulation(case, M, n, k, dtype, sms):
    w = CASES[case](n, k, 13)
    m = repack_int4(w)
    x = _round16(np.random.default_rng(3).standard_normal((M, k)), dtype).astype(np.float64)
    got, w_eff, counters, plan = emulate_v2(x, m, dtype, sms=sms)
    assert not counters.any()                      # the last blocks left the counters at zero
    ref = x @ w_eff.astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the B operand is the dequantized checkpoint weight, rounded once
    np.testing.assert_allclose(w_eff, w.dequantize(), rtol=1e-2, atol=1e-6)
    if plan[4]:  # shared columns: whichever block comes last, the sums are bit for bit the same
        again, _, _, _ = emulate_v2(x, m, dtype, sms=sms, arrival_seed=7)
        np.testing.assert_array_equal(got, again)


def test_plans_of_the_emulation_cases_share_columns():
    """The cases above exercise the global reduce (not only whole columns)."""
    assert v2_plan(5, 136, 1024, 4)[4] > 0
    assert v2_plan(16, 296, 640, 3)[3] == 4 and v2_plan(16, 296, 640, 3)[4] > 0  # 8..12
    assert v2_plan(40, 264, 1024, 4)[4] > 0
    assert v2_plan(33, 72, 128, 64)[4] == 0
    assert v2_plan(1, 1280, 512, 4)[1:4] == (8, 1, 5)


def test_reading_without_the_swizzle_breaks_it():
    """The XOR swizzle of the A tile is load-bearing: reads that skip it give wrong sums."""
    w = CASES["awq-g128"](72, 256, 13)
    m = repack_int4(w)
    x = _round16(np.random.default_rng(3).standard_normal((9, 256)), "f16").astype(np.float64)
    got, w_eff, _, _ = emulate_v2(x, m, "f16", sms=2, read_swizzle=False)
    ref = x @ w_eff.astype(np.float64).T
    assert not np.allclose(got, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
