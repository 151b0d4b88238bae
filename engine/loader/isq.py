"""In-situ quantization (--isq): a float checkpoint's projection matrices to ggml blocks at load.

The seven projections of every layer, and of every expert, are quantized (OpenMP over rows inside each tensor, a progress
bar over tensors); embeddings and lm_head keep the checkpoint's dtype, since they decide every
token and are a lookup and one matmul per step. A row length the type's block does not divide
falls back as llama.cpp's quantizer does (llama_tensor_get_type): Q4_K to Q5_0, Q5_K to Q5_1,
Q6_K to Q8_0, and Q2_K/Q3_K to Q4_0 (llama.cpp now picks IQ4_NL, which Taper lacks); a row
length 32 does not divide stays in float. Start-up lists every tensor that fell back.

`--isq marlin` is the one non-ggml type, asked for by name (a ggml type never turns into it):
each projection becomes an Int4Weight (pyx/weights/int4.py) by symmetric round-to-nearest in
float32, groups of 128 along K, scale = max|w| / 7 per group, code = clip(round(w / scale), -8, 7)
+ 8 with zero 8 (an all-zero group gets scale 0 and codes 8). A row length 128 does not divide is
quantized per channel (one group of K), and one 32 does not divide (Int4Weight's packing) stays
in float; start-up says which. The CPU backend runs these through the int4 kernels, the CUDA
backend repacks them to the Marlin layout (pyx/weights/marlin.py) when placing them.
"""
from __future__ import annotations

import logging
import re

import numpy as np
from gguf import GGMLQuantizationType as QT
from tqdm import tqdm

from pyx.cpu_backend import quantize_weight
from pyx.weights.ggml import ISQ_TYPES
from pyx.weights.int4 import Int4Part, Int4Weight

log = logging.getLogger("taper.loader")

# attention (Phi-3's fused qkv_proj too), the dense MLP (Phi-3's fused gate_up_proj too), each
# expert (Qwen MoE names, Mixtral's w1/w2/w3) and Qwen2-MoE's shared expert; the routers
# (mlp.gate, shared_expert_gate) stay float, as llama.cpp keeps them F32.
_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv|[qkvo])_proj"
                         r"|mlp\.((experts\.\d+\.|shared_expert\.)?(gate_up|gate|up|down)_proj)"
                         r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.Q4_0,
             QT.Q3_K: QT.Q4_0}
MARLIN = "marlin"          # --isq marlin: int4 W4A16 (Int4Weight; Marlin on the GPU)
MARLIN_GROUP = 128
ISQ_CHOICES = (*ISQ_TYPES, MARLIN)
_BLOCK = {t: (256 if t in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K) else 32)
          for t in ISQ_TYPES.values()}


def check_isq(name: str) -> str:
    """An --isq value, lower-cased, or ValueError listing the choices."""
    if name.lower() not in ISQ_CHOICES:
        raise ValueError(f"--isq {name}: unknown type; choose from {', '.join(ISQ_CHOICES)}")
    return name.lower()


def isq_type(name: str) -> QT:
    """The ggml type for an --isq value, or ValueError listing the choices."""
    if check_isq(name) == MARLIN:
        raise ValueError("--isq marlin is int4 (Int4Weight), not a ggml type")
    return ISQ_TYPES[name.lower()]


def marlin_group(k: int) -> int | None:
    """The group size --isq marlin uses for rows of k: 128, k (per channel), or None (float)."""
    if k % MARLIN_GROUP == 0:
        return MARLIN_GROUP
    return k if k % 32 == 0 and k > 0 else None


def quantize_int4(weight: np.ndarray, group_size: int) -> Int4Weight:
    """A float (N, K) matrix -> Int4Weight by symmetric round-to-nearest in float32 (see the
    module docstring), vectorised over the whole matrix."""
    n, k = weight.shape
    g = int(group_size)
    if g <= 0 or k % g or k % 32:
        raise ValueError(f"int4 quantization needs K ({k}) a multiple of 32 and of the group "
                         f"size ({g})")
    x = np.asarray(weight, dtype=np.float32).reshape(n, k // g, g)
    scales = np.maximum(x.max(axis=2), -x.min(axis=2)) / np.float32(7)
    q = x / np.where(scales > 0, scales, np.float32(1))[..., None]    # a new array
    np.rint(q, out=q)
    np.clip(q, -8, 7, out=q)
    q += 8
    codes = q.astype(np.uint8).reshape(n, k)
    zeros = np.full(scales.shape, 8, np.float32)
    return Int4Weight([Int4Part.from_codes(codes, scales, zeros, g)], k)


def type_for(qtype: QT, k: int) -> QT | None:
    """The type a row of k elements gets: qtype, its fallback, or None (stays float)."""
    if k % _BLOCK[qtype] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if k % _BLOCK[qtype] == 0 else None


def quantize_weights(weights: dict, isq: str, progress: bool = True) -> None:
    """Replace the projection matrices in `weights` (Hugging Face names) by QuantizedWeights
    (ggml types) or Int4Weights (marlin)."""
    # float matrices only: a GGUF's blocks or a GPTQ/AWQ/FP8 checkpoint's packed weights stay
    names = [n for n in weights if _PROJECTION.match(n) and isinstance(weights[n], np.ndarray)]
    if check_isq(isq) == MARLIN:
        return _quantize_marlin(weights, names, progress)
    want = isq_type(isq)
    fell_back: dict[str, str] = {}
    for name in tqdm(names, desc=f"quantizing to {want.name}", unit="tensor",
                     disable=not progress):
        k = weights[name].shape[1]
        qtype = type_for(want, k)
        if qtype != want:
            fell_back[name] = qtype.name if qtype is not None else "float (kept)"
        if qtype is not None:
            weights[name] = quantize_weight(weights[name], qtype)
    if fell_back:
        log.warning("--isq %s: %d tensors have rows %s's block does not divide and fell back: %s",
                    isq, len(fell_back), want.name,
                    ", ".join(f"{n} -> {t}" for n, t in fell_back.items()))
    log.info("--isq %s: quantized %d projection matrices", isq, len(names))


def _quantize_marlin(weights: dict, names: list[str], progress: bool) -> None:
    """--isq marlin: one matrix at a time to an Int4Weight; logs the group sizes chosen."""
    per_channel, kept = [], []
    for name in tqdm(names, desc="quantizing to int4 (marlin)", unit="tensor",
                     disable=not progress):
        k = weights[name].shape[1]
        g = marlin_group(k)
        if g is None:
            kept.append(name)
            continue
        if g != MARLIN_GROUP:
            per_channel.append(name)
        weights[name] = quantize_int4(weights[name], g)
    if per_channel:
        log.info("--isq marlin: %d tensors have rows 128 does not divide and are quantized per "
                 "channel: %s", len(per_channel), ", ".join(per_channel))
    if kept:
        log.warning("--isq marlin: %d tensors have rows 32 does not divide and stay float: %s",
                    len(kept), ", ".join(kept))
    log.info("--isq marlin: quantized %d projection matrices to int4 (symmetric, groups of %d "
             "along K, %d per channel)", len(names) - len(kept), MARLIN_GROUP, len(per_channel))
