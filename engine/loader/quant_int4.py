"""GPTQ and AWQ 4-bit checkpoints (AutoGPTQ / GPTQModel, AutoAWQ) to Int4Weights, in place.

Both store, per layer of an (N, K) weight with groups of G along K (G = K when group_size is -1),
int32 words holding 8 codes each, nibble i in bits 4i..4i+3, and W[n, k] = scale * (code - zero):

  GPTQ  qweight (K/8, N)  packs along K: code (k, n) is nibble k % 8 of word (k / 8, n).
        qzeros  (K/G, N/8) packs along N: zero (g, n) is nibble n % 8 of word (g, n / 8).
        scales  (K/G, N) f16;  g_idx (K,) int32, the group of each k (act order when not k / G).
        checkpoint_format "gptq" (v1: AutoGPTQ, and GPTQModel's default export) stores zero - 1
        in each nibble, so a nibble reads back plus one, 15 as 16 (vLLM's GPTQ kernels read it so);
        "gptq_v2" stores the zero. A symmetric checkpoint's zero is 8 (v1 nibbles 7).
  AWQ   (AutoAWQ "gemm" version) qweight (K, N/8) packs along N in an interleaved order: nibble
        i of word (k, j) is column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros (K/G, N/8) the same,
        zeros as stored; scales (K/G, N) f16.

Each layer's tensors are replaced by one Int4Weight under `<layer>.weight` (pyx/weights/int4.py)
that keeps them as its source. What this does not run is a start-up error naming the variant.
"""
from __future__ import annotations

import numpy as np

from pyx.weights.int4 import Int4Part, Int4Source, Int4Weight

# AutoAWQ packs column [0, 2, 4, 6, 1, 3, 5, 7][i] into nibble i; so column c is in nibble:
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def nibbles(words: np.ndarray) -> np.ndarray:
    """(..., W) int32 words -> (..., 8W) uint8: nibble i of word w is element 8w + i. Split as
    bytes (a little-endian word's byte j holds nibbles 2j and 2j + 1) so nothing wider than a
    byte per code is ever allocated."""
    b = np.ascontiguousarray(words).view(np.uint8)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def convert_gptq_awq(weights: dict, qc: dict) -> None:
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits} is not supported (4-bit only)")
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise ValueError(f"{method} checkpoint has group_size={group_size!r}; expected a "
                         "positive group size or -1 (per channel)")
    if method == "gptq":
        fmt = _gptq_format(qc, group_size)
        sym = bool(qc.get("sym", True))
    else:
        fmt = _awq_format(qc)
        sym = not qc.get("zero_point", True)     # informational: AWQ always stores qzeros
    layers = sorted(n[:-len(".qweight")] for n in weights if n.endswith(".qweight"))
    if not layers:
        raise ValueError(f"{method} checkpoint has no .qweight tensors")
    for name in layers:
        convert = _gptq_layer if method == "gptq" else _awq_layer
        weights[f"{name}.weight"] = convert(weights, name, fmt, group_size, sym)
    stray = [n for n in weights if n.endswith((".qzeros", ".scales", ".g_idx"))]
    if stray:
        raise ValueError(f"{method} checkpoint: {stray[0]} belongs to no .qweight")


def _gptq_format(qc: dict, group_size: int) -> str:
    if qc.get("is_marlin_format"):
        raise ValueError("gptq checkpoint in Marlin format (is_marlin_format) is not supported; "
                         "supported: checkpoint_format gptq, gptq_v2")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, "
                         "gptq_v2")
    # With one group per row, act order changes nothing in the stored layout (vLLM agrees).
    if qc.get("desc_act") and group_size != -1:
        raise ValueError("gptq checkpoint with desc_act=true (act-order) is not supported; "
                         "quantize with desc_act=false")
    if qc.get("dynamic"):
        raise ValueError("gptq checkpoint with per-module `dynamic` overrides is not supported")
    pack = str(qc.get("pack_dtype") or "int32").replace("torch.", "")
    if pack != "int32":
        raise ValueError(f"gptq checkpoint with pack_dtype {pack} is not supported (int32 only)")
    return fmt


def _awq_format(qc: dict) -> str:
    version = str(qc.get("version") or qc.get("format") or qc.get("checkpoint_format")
                  or "gemm").lower()
    if version != "gemm":
        raise ValueError(f"awq checkpoint version {version!r} is not supported; supported: gemm")
    return "awq"


def _take(weights: dict, name: str, suffix: str, optional: bool = False):
    key = f"{name}.{suffix}"
    if key not in weights:
        if optional:
            return None
        raise ValueError(f"quantized layer {name} has no {suffix} tensor")
    return weights.pop(key)


def _expect(name: str, what: str, array: np.ndarray, shape: tuple, dtype=None) -> None:
    if tuple(array.shape) != shape or (dtype is not None and array.dtype != dtype):
        want = f"{list(shape)}" + (f" {np.dtype(dtype)}" if dtype is not None else "")
        raise ValueError(f"quantized layer {name}: {what} is {list(array.shape)} {array.dtype}, "
                         f"expected {want}")


def _groups(name: str, k: int, group_size: int) -> int:
    g = k if group_size == -1 else group_size
    if k % 32 or g % 32 or k % g:
        raise ValueError(f"quantized layer {name}: row length {k} and group size {g} must be "
                         "multiples of 32, the group size dividing the row length")
    return g


def check_g_idx(name: str, g_idx, k: int, g: int) -> None:
    """Act-order g_idx (groups not k // G) would need the activations permuted: refused."""
    if g_idx is None:
        return
    _expect(name, "g_idx", g_idx, (k,))
    if not np.array_equal(np.asarray(g_idx), np.arange(k) // g):
        raise ValueError(f"quantized layer {name} has an act-order g_idx (groups not in order "
                         "k // group_size), which is not supported")


def _gptq_layer(weights: dict, name: str, fmt: str, group_size: int, sym: bool) -> Int4Weight:
    qweight = _take(weights, name, "qweight")
    qzeros = _take(weights, name, "qzeros", optional=sym)
    scales = _take(weights, name, "scales")
    g_idx = _take(weights, name, "g_idx", optional=True)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g = _groups(name, k, group_size)
    _expect(name, "qweight", qweight, (k // 8, n), np.int32)
    _expect(name, "scales", scales, (k // g, n))
    check_g_idx(name, g_idx, k, g)
    if qzeros is None:
        zeros = np.full((n, k // g), 8, np.float32)
    else:
        _expect(name, "qzeros", qzeros, (k // g, n // 8), np.int32)
        zeros = nibbles(qzeros).T.astype(np.float32) + (1 if fmt == "gptq" else 0)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    source = Int4Source(name, fmt, {s: t for s, t in tensors.items() if t is not None}, g, sym,
                        (n, k))
    part = Int4Part.from_words(qweight.T, np.asarray(scales, np.float32).T, zeros, g)
    return Int4Weight([part], k, [source])


def _awq_layer(weights: dict, name: str, fmt: str, group_size: int, sym: bool) -> Int4Weight:
    qweight = _take(weights, name, "qweight")
    qzeros = _take(weights, name, "qzeros")
    scales = _take(weights, name, "scales")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = _groups(name, k, group_size)
    _expect(name, "qweight", qweight, (k, n // 8), np.int32)
    _expect(name, "qzeros", qzeros, (k // g, n // 8), np.int32)
    _expect(name, "scales", scales, (k // g, n))
    codes = _awq_columns(qweight)
    zeros = _awq_columns(qzeros).astype(np.float32)
    source = Int4Source(name, fmt, {"qweight": qweight, "qzeros": qzeros, "scales": scales}, g,
                        sym, (n, k))
    part = Int4Part.from_codes(codes, np.asarray(scales, np.float32).T, zeros, g)
    return Int4Weight([part], k, [source])


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """(R, N/8) AWQ words -> (N, R) uint8 codes, row 8j + c from nibble AWQ_REVERSE_ORDER[c] of
    word column j: one shift-and-mask pass per nibble over the transposed words, rather than an
    unpack and a gather of every code."""
    t = np.ascontiguousarray(words.T).view(np.uint32)            # (N/8, R)
    out = np.empty((t.shape[0], 8, t.shape[1]), np.uint8)
    for c, nibble in enumerate(AWQ_REVERSE_ORDER):
        out[:, c] = (t >> np.uint32(4 * nibble)) & np.uint32(15)
    return out.reshape(-1, t.shape[1])
