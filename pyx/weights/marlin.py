"""The Marlin layout for 4-bit weights (W4A16 on the GPU, cuda/marlin.cu), and its CPU reference
repack from any `Int4Weight` (GPTQ, AWQ, compressed-tensors: pyx/weights/int4.py).

The trick (Marlin, Frantar et al. 2024): store the int4 codes in the order in which a warp's
tensor-core fragments consume them, so that the GEMM kernel reads each weight byte once, with
one 16-byte load per lane, and dequantizes it in registers right before the MMA.

Layout. W is (N, K), W[n, k] = scale[g, n] * (code[n, k] - zero[g, n]), g = k // G. N is padded
to Np = ceil(N / 64) * 64 with code 8, scale 0, zero 8 (padded columns are 0 and never written).
The weight is cut into tiles of 16 k by 64 n; tile (kt, nt) is 512 bytes, 32 lanes times 4 words,
in qweight (K/16, Np*2) uint32 at qweight[kt, nt*128 + lane*4 + j], so one k-step of a warp's
16 x 64 output tile is one fully coalesced 512-byte read. mma.sync m16n8k16's B operand
(16 k x 8 n, "col") gives lane l = 4c + t (c = l // 4, t = l % 4) register h in {0, 1} holding
(k, n) = (2t + 8h + e, c) for e in {0, 1} (e = 0 in the low half). A 64-wide tile is 8 such n8
blocks blk; word j of lane l holds blocks 2j and 2j + 1, and nibble i (bits 4i..4i+3) of it is

    e = i // 4, b = (i % 4) // 2, h = i % 2:   k = 16 kt + 2t + 8h + e,  n = 64 nt + 8(2j + b) + c

so nibbles (0, 4), (1, 5), (2, 6), (3, 7) are the B registers (blk 2j, h 0), (2j, 1), (2j+1, 0),
(2j+1, 1): `(w >> 4s) & 0x000f000f` puts one register's two codes in the two 16-bit halves, which
the magic-number trick (OR 0x6400 for f16, 0x4300 for bf16, then subtract 1024 / 128 plus the
zero) turns into the two values without a conversion instruction.

scales (K/G, Np) float32 and zeros (K/G, Np) uint8 (or None) are permuted within each 64-column
tile: position 64 nt + 8c + blk holds column 64 nt + 8 blk + c, so lane l reads the 8 scales of
its 8 columns (one per n8 block) as 32 contiguous bytes, and its 8 zeros as 8 bytes.

Choices:
- Scales stay float32, as Int4Weight keeps them: the repack is lossless whatever the checkpoint's
  scale dtype (f16 for GPTQ/AWQ, bf16 for some compressed-tensors), and unpack_marlin equals
  Int4Weight.dequantize bit for bit. The kernel converts a scale once per group.
- Zeros are integer codes, one uint8 per (group, column): 0..15, and 16 for GPTQ v1 (which stores
  zero - 1 in a nibble, so int4 codes cannot hold them). A weight whose zeros are all 8
  (symmetric GPTQ and compressed-tensors) keeps zeros = None and the kernel subtracts 8.
- One group size per MarlinWeight. Int4Weight parts with different group sizes (fused q/k/v of
  differently quantized layers) are repacked at the gcd of their group sizes with repeated
  scales, which is exact.
- Fusion (q/k/v, gate/up) happens before the repack: Int4Weight.concat, then repack_int4 (the
  loader's order). MarlinWeight.concat exists for checkpoints stored in this layout; it round-trips
  through the canonical codes, which is exact.

Requirements: K % 16 == 0 and G % 16 == 0 (Int4Weight guarantees multiples of 32).
Both GEMM variants of cuda/marlin.cu (the simple kernel and kernels marlin=pipeline) read this
one layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from pyx.weights.int4 import Int4Part, Int4Weight

TILE_K = 16           # k per tile (one mma k-step)
TILE_N = 64           # n per tile (8 n8 blocks)
SYM_ZERO = 8          # the zero of zeros=None

# codes (Np, K) viewed as [nt, j, b, c, kt, h, t, e] -> qweight order [kt, nt, c, t, j, e, b, h]
# (lane = 4c + t, word j, nibble i = 4e + 2b + h).
_PERM = (4, 0, 3, 6, 1, 7, 2, 5)
_INV_PERM = tuple(int(i) for i in np.argsort(_PERM))
_SHIFTS = (np.arange(8, dtype=np.uint32) * 4).astype(np.uint32)


@dataclass(slots=True)
class MarlinWeight:
    qweight: np.ndarray           # (K/16, Np*2) uint32, the tile layout above
    scales: np.ndarray            # (K/G, Np) float32, columns permuted per 64-tile
    zeros: np.ndarray | None      # (K/G, Np) uint8, permuted alike; None: every zero is 8
    k: int
    n: int                        # true N (Np = ceil(n / 64) * 64)
    group_size: int               # G (K for per-channel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def n_padded(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + (0 if self.zeros is None
                                                            else self.zeros.nbytes)

    def dequantize(self) -> np.ndarray:
        return unpack_marlin(self)

    @staticmethod
    def concat(weights: list["MarlinWeight"]) -> "MarlinWeight":
        """Stack along N (exact: through the canonical codes, at the gcd of the group sizes)."""
        k = weights[0].k
        if any(w.k != k for w in weights):
            raise ValueError("marlin weights to fuse must have the same row length")
        g = 0
        for w in weights:
            g = gcd(g, w.group_size)
        codes, scales, zeros = [], [], []
        for w in weights:
            c, s, z = canonical(w)
            r = w.group_size // g
            codes.append(c)
            scales.append(np.repeat(s, r, axis=1))
            zeros.append(None if z is None else np.repeat(z, r, axis=1))
        if all(z is None for z in zeros):
            zs = None
        else:
            zs = np.concatenate([np.full(s.shape, SYM_ZERO, np.uint8) if z is None else z
                                 for z, s in zip(zeros, scales)])
        return pack_marlin(np.concatenate(codes), np.concatenate(scales), zs, g)


# ---- repack (CPU reference) and its inverse

def repack_int4(weight: Int4Weight) -> MarlinWeight:
    """An Int4Weight (any source format, any parts) -> MarlinWeight, losslessly."""
    k = weight.k
    g = 0
    for p in weight.parts:
        g = gcd(g, p.group_size)
    codes = np.concatenate([p.codes() for p in weight.parts])
    scales = np.concatenate([np.repeat(p.scales, p.group_size // g, axis=1)
                             for p in weight.parts])
    zf = np.concatenate([np.repeat(p.zeros, p.group_size // g, axis=1) for p in weight.parts])
    if codes.shape[1] != k:
        raise ValueError(f"int4 weight codes have {codes.shape[1]} columns, expected {k}")
    zi = np.rint(zf)
    if not (np.array_equal(zi, zf) and (zi.size == 0 or (zi.min() >= 0 and zi.max() <= 255))):
        raise ValueError("marlin repack needs integer zero points in 0..255 (GPTQ, AWQ and "
                         "compressed-tensors store 0..16)")
    zeros = None if np.all(zi == SYM_ZERO) else zi.astype(np.uint8)
    return pack_marlin(codes, scales, zeros, g)


def pack_marlin(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                group_size: int) -> MarlinWeight:
    """Canonical codes (N, K) uint8 0..15, scales (N, K/G) float32, zeros (N, K/G) uint8 or None
    -> the Marlin layout."""
    n, k = codes.shape
    g = int(group_size)
    if k % TILE_K or g % TILE_K or k % g or g <= 0:
        raise ValueError(f"marlin layout needs K ({k}) and the group size ({g}) multiples of "
                         f"{TILE_K}, the group size dividing K")
    if scales.shape != (n, k // g) or (zeros is not None and zeros.shape != (n, k // g)):
        raise ValueError(f"marlin pack: scales {scales.shape} / zeros for codes {codes.shape} "
                         f"with group size {g}")
    np_ = -(-n // TILE_N) * TILE_N
    c = np.full((np_, k), SYM_ZERO, np.uint8)
    c[:n] = codes
    s = np.zeros((np_, k // g), np.float32)
    s[:n] = scales
    arr = c.reshape(np_ // 64, 4, 2, 8, k // 16, 2, 4, 2).transpose(_PERM)
    arr = np.ascontiguousarray(arr).reshape(k // 16, np_ * 2, 8).astype(np.uint32)
    qweight = np.bitwise_or.reduce(arr << _SHIFTS, axis=2).astype(np.uint32)
    z = None
    if zeros is not None:
        zp = np.full((np_, k // g), SYM_ZERO, np.uint8)
        zp[:n] = zeros
        z = _permute_columns(zp.T)
    return MarlinWeight(qweight, _permute_columns(s.T), z, k, n, g)


def canonical(w: MarlinWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MarlinWeight -> (codes (N, K) uint8, scales (N, K/G) float32, zeros (N, K/G) uint8 or
    None), the inverse of pack_marlin."""
    k, n, np_ = w.k, w.n, w.n_padded
    nib = ((w.qweight[..., None] >> _SHIFTS) & np.uint32(15)).astype(np.uint8)
    nib = nib.reshape(k // 16, np_ // 64, 8, 4, 4, 2, 2, 2).transpose(_INV_PERM)
    codes = np.ascontiguousarray(nib).reshape(np_, k)[:n]
    scales = np.ascontiguousarray(_permute_columns(w.scales).T[:n])
    zeros = None if w.zeros is None else np.ascontiguousarray(_permute_columns(w.zeros).T[:n])
    return codes, scales, zeros


def unpack_marlin(w: MarlinWeight) -> np.ndarray:
    """(N, K) float32 = scale * (code - zero), the same float32 operations as
    Int4Weight.dequantize (so the two agree bit for bit)."""
    codes, scales, zeros = canonical(w)
    g = w.group_size
    z = (np.full(scales.shape, SYM_ZERO, np.float32) if zeros is None
         else zeros.astype(np.float32))
    return np.repeat(scales, g, axis=1) * (codes.astype(np.float32) - np.repeat(z, g, axis=1))


def to_int4(w: MarlinWeight, sources: list | None = None) -> Int4Weight:
    """MarlinWeight -> an Int4Weight (one part) for the CPU backend."""
    codes, scales, zeros = canonical(w)
    z = (np.full(scales.shape, SYM_ZERO, np.float32) if zeros is None
         else zeros.astype(np.float32))
    return Int4Weight([Int4Part.from_codes(codes, scales, z, w.group_size)], w.k,
                      list(sources or []))


def _permute_columns(a: np.ndarray) -> np.ndarray:
    """(R, Np): within each 64 columns, position 8c + blk <-> column 8 blk + c (an involution)."""
    r, np_ = a.shape
    return np.ascontiguousarray(a.reshape(r, np_ // 64, 8, 8).transpose(0, 1, 3, 2)
                                ).reshape(r, np_)
