"""The wgmma operand contract of the Hopper prefill kernel (cuda/attention_prefill_fa3.cu,
cuda/wgmma.cuh), replayed on the CPU.

Without a GPU the kernel cannot run here (tests/gpu/test_cuda_prefill_fa2.py runs it under
kernels prefill=fa3); its index arithmetic can. The kernel's side, transcribed: where the
cp.async writers put element (row, column) of a Q, K or V tile (fa3_tile_offset), the 64-bit
descriptors it builds (wgmma_desc) and the start offsets of each k16 slice, and which
accumulator registers it packs into P's A fragments. The hardware's side, from the PTX ISA
("Shared Memory Matrix Layout": the canonical layouts as CuTe layouts, the Swizzle<3,4,3> of the
128-byte mode on byte addresses, the descriptor's bit fields) and CUTLASS's thread-value layouts
of the m64nNk16 register fragments (cute/atom/mma_traits_sm90_gmma.hpp: CLayout_64xN for the f32
accumulators, ALayout_64x16 for a 16-bit A from registers): what a wgmma reading those
descriptors and registers multiplies. The
replay multiplies what the hardware would read and compares it with NumPy's Q K^T and P V; the
controls show that an unswizzled writer, exchanged LBO / SBO, or a mis-packed P all break it.
"""
from __future__ import annotations

import numpy as np
import pytest

M = N = 64      # F3_M, F3_N: packed rows per block, keys per tile
T = 8           # 16-bit elements per 16 bytes (the PTX layouts' T)


# ---- the kernel's side (cuda/wgmma.cuh, cuda/attention_prefill_fa3.cu)

def fa3_tile_offset(R, r, col):
    return (col // 64) * R * 128 + r * 128 + ((((col % 64) // 8) ^ (r % 8)) << 4) + (col % 8) * 2


def wgmma_desc(addr, lbo, sbo):
    return (((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16)
            | (((sbo & 0x3FFFF) >> 4) << 32) | (1 << 62))


def write_tile(smem, base, tile, swizzled=True):
    """The producer's (and the Q loader's) cp.async copies: 16-byte chunk `part` of row r."""
    R, C = tile.shape
    for r in range(R):
        for part in range(C // 8):
            off = fa3_tile_offset(R, r, part * 8) if swizzled else r * C * 2 + part * 16
            smem[base + off:base + off + 16] = tile[r, part * 8:part * 8 + 8].view(np.uint8)


def qk_descs(sQ, sK, D, swap=False):
    """S = Q K^T's descriptors per k16 slice kk: both K-major, LBO 16 (unused), SBO 1024."""
    for kk in range(D // 16):
        koff = (kk // 4) * M * 128 + (kk % 4) * 32
        lbo, sbo = (1024, 16) if swap else (16, 1024)
        yield wgmma_desc(sQ + koff, lbo, sbo), wgmma_desc(sK + koff, lbo, sbo)


def v_descs(sV, swap=False):
    """O += P V's B descriptors per k16 slice: MN-major, LBO = the next 64 dims, SBO = 8 keys."""
    for kk in range(N // 16):
        lbo, sbo = (1024, N * 128) if swap else (N * 128, 1024)
        yield wgmma_desc(sV + kk * 16 * 128, lbo, sbo)


def pack_p(s_frag):
    """The consumer's pa[kk][i] from s[4 n + e] (per thread): pairs of accumulators."""
    return [[(s_frag[8 * kk + 2 * i], s_frag[8 * kk + 2 * i + 1]) for i in range(4)]
            for kk in range(N // 16)]


# ---- the hardware's side (PTX ISA)

def layout(shape, stride, coord):
    """A CuTe layout: coord (an int per top mode) split colexicographically over the mode's
    sub-shape, dotted with the strides."""
    off = 0
    for c, shp, std in zip(coord, shape, stride):
        for s_, d_ in zip(shp, std):
            off += (c % s_) * d_
            c //= s_
    return off


def swizzle128(addr):  # Swizzle<3,4,3> on byte addresses: bits [4, 7) ^= bits [7, 10)
    return addr ^ (((addr >> 7) & 7) << 4)


def decode(desc):
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    assert (desc >> 49) & 7 == 0 and desc >> 62 == 1  # base offset 0, 128-byte swizzle
    return start, lbo // 2, sbo // 2  # LBO / SBO in elements, as in the CuTe layouts


def read_k_major(smem, desc, rows, dt):
    """Operand (rows x 16) K-major: ((8, m), (T, 2k)) : ((8T, SBO), (1, T)), k = 1."""
    start, _, sbo = decode(desc)
    out = np.empty((rows, 16), dt)
    for i in range(rows):
        for k in range(16):
            a = swizzle128(start + 2 * layout(((8, rows // 8), (T, 2)), ((8 * T, sbo), (1, T)),
                                              (i, k)))
            out[i, k] = smem[a:a + 2].view(dt)[0]
    return out


def read_mn_major(smem, desc, cols, dt):
    """Operand B (16 x cols) MN-major: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO)), k = 2."""
    start, lbo, sbo = decode(desc)
    out = np.empty((16, cols), dt)
    for k in range(16):
        for n in range(cols):
            a = swizzle128(start + 2 * layout(((T, 8, max(cols // 64, 1)), (8, 2)),
                                              ((1, T, lbo), (8 * T, sbo)), (n, k)))
            out[k, n] = smem[a:a + 2].view(dt)[0]
    return out


# CUTLASS's (thread, value) -> column-major (M = 64) index layouts
TV_THREADS = ((4, 8, 4), (128, 1, 16))


def acc_coord(thread, r):
    """(row, column) of accumulator register r of warpgroup thread `thread`: CLayout_64xN =
    ((4, 8, 4), (2, 2, N / 8)) : ((128, 1, 16), (64, 8, 512))."""
    idx = layout((TV_THREADS[0], (2, 2, 32)), (TV_THREADS[1], (64, 8, 512)), (thread, r))
    return idx % 64, idx // 64


def a_coord(thread, i, h):
    """(row, k) of element h (low, high half) of A register i: ALayout_64x16 =
    ((4, 8, 4), (2, 2, 2)) : ((128, 1, 16), (64, 8, 512)), values 2 i + h."""
    idx = layout((TV_THREADS[0], (2, 2, 2)), (TV_THREADS[1], (64, 8, 512)), (thread, 2 * i + h))
    return idx % 64, idx // 64


# ---- the replay

def smem_with_tiles(q, k, v, swizzled=True):
    D = q.shape[1]
    tile = M * D * 2
    smem = np.zeros(1024 + 3 * tile, np.uint8)
    sQ, sK, sV = 1024, 1024 + tile, 1024 + 2 * tile  # 1024-aligned, as the kernel rounds up
    for base, t in ((sQ, q), (sK, k), (sV, v)):
        write_tile(smem, base, t, swizzled)
    return smem, sQ, sK, sV


def replay_scores(smem, sQ, sK, D, dt, swap=False):
    s = np.zeros((M, N))
    for da, db in qk_descs(sQ, sK, D, swap):
        a = read_k_major(smem, da, M, dt).astype(np.float64)
        b = read_k_major(smem, db, N, dt).astype(np.float64)  # B K-major: row n = key n
        s += a @ b.T
    return s


def replay_pv(smem, sV, p, D, dt, swap=False, repack=pack_p):
    """P (64 x 64) through the accumulator -> A-fragment packing, times V from the descriptors."""
    frags = [[p[acc_coord(t, r)] for r in range(N // 2)] for t in range(128)]
    o = np.zeros((M, D))
    packed = [repack(f) for f in frags]
    for kk, desc in enumerate(v_descs(sV, swap)):
        a = np.zeros((M, 16))
        for t in range(128):
            for i in range(4):
                for h in range(2):
                    row, col = a_coord(t, i, h)
                    a[row, col] = packed[t][kk][i][h]
        b = read_mn_major(smem, desc, D, dt).astype(np.float64)
        o += a @ b
    return o


def dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def tiles(rng, D, dt):
    return [rng.standard_normal((64, D)).astype(dt) for _ in range(3)]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dt_name", ["bf16", "f16"])
def test_descriptors_read_what_the_writers_wrote(D, dt_name):
    dt = dtype(dt_name)
    q, k, v = tiles(np.random.default_rng(D), D, dt)
    smem, sQ, sK, sV = smem_with_tiles(q, k, v)
    s = replay_scores(smem, sQ, sK, D, dt)
    np.testing.assert_allclose(s, q.astype(np.float64) @ k.astype(np.float64).T, rtol=1e-12,
                               atol=1e-9)
    p = np.random.default_rng(1).random((M, N))
    o = replay_pv(smem, sV, p, D, dt)
    np.testing.assert_allclose(o, p @ v.astype(np.float64), rtol=1e-12, atol=1e-9)


def test_kernel_offsets_fit_the_descriptor_fields():
    """Every address and offset is a multiple of 16 below 2^18 (14-bit fields), tiles and slices
    start where the 128-byte pattern does (1024) or inside its first row (the K-major k16 slices,
    + 32 (kk % 4)), so the descriptors' base offset is 0."""
    from math import gcd
    for D, stages in ((64, 3), (128, 2)):
        tile = M * D * 2
        assert tile % 1024 == 0 and (M * 128) % 1024 == 0
        smem = tile * (1 + 2 * stages) + 2 * stages * 8 + 1024
        assert smem < 2 ** 18 and smem <= 227 * 1024 // 2, (D, smem)  # two blocks per SM
        for kk in range(D // 16):
            koff = (kk // 4) * M * 128 + (kk % 4) * 32
            assert koff % 16 == 0 and (koff % 1024) < 128
    assert gcd(16 * 128, 1024) == 1024  # V slices start on 1024-byte boundaries


@pytest.mark.parametrize("broken", ["unswizzled writer", "LBO/SBO exchanged", "P packed wrong"])
def test_controls_break_the_replay(broken):
    """The replay sees the contract: each of these mistakes changes the product."""
    D, dt = 128, dtype("bf16")
    q, k, v = tiles(np.random.default_rng(7), D, dt)
    smem, sQ, sK, sV = smem_with_tiles(q, k, v, swizzled=broken != "unswizzled writer")
    p = np.random.default_rng(2).random((M, N))
    swap = broken == "LBO/SBO exchanged"
    s = replay_scores(smem, sQ, sK, D, dt, swap=swap)
    repack = pack_p
    if broken == "P packed wrong":  # a1 and a2 exchanged: rows + 8 and keys + 8 confused
        def repack(f):
            return [[x[0], x[2], x[1], x[3]] for x in pack_p(f)]
    o = replay_pv(smem, sV, p, D, dt, swap=swap, repack=repack)
    s_ok = np.allclose(s, q.astype(np.float64) @ k.astype(np.float64).T)
    o_ok = np.allclose(o, p @ v.astype(np.float64))
    assert not (s_ok and o_ok), f"{broken}: the replay did not notice"


def test_softmax_and_epilogue_indexing_matches_the_accumulator_layout():
    """The consumer's masks, quad reductions and output stores treat s[4 n + e] / o[4 n + e] of
    lane (g = lane / 4, c = lane % 4) in warp w as row 16 w + g + 8 (e / 2), column
    8 n + 2 c + e % 2 (fa2's mma.sync convention): CUTLASS's accumulator layout must agree, and a
    row's columns must live in one quad (the shuffles over lane ^ 1, lane ^ 2)."""
    for t in range(128):
        w, lane = divmod(t, 32)
        g, c = divmod(lane, 4)
        for n in range(128 // 8):
            for e in range(4):
                assert acc_coord(t, 4 * n + e) == (16 * w + g + 8 * (e // 2), 8 * n + 2 * c + e % 2)
    rows = {}
    for t in range(128):
        for r in range(32):
            rows.setdefault(acc_coord(t, r)[0], set()).add(t // 4)
    assert all(len(quads) == 1 for quads in rows.values())
