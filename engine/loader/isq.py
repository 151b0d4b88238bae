"""In-situ quantization (--isq): a float checkpoint's projection matrices to ggml blocks at load.

The seven projections of every layer are quantized (OpenMP over rows inside each tensor, a progress
bar over tensors); embeddings and lm_head keep the checkpoint's dtype, since they decide every
token and are a lookup and one matmul per step. A row length the type's block does not divide
falls back as llama.cpp's quantizer does (llama_tensor_get_type): Q4_K to Q5_0, Q5_K to Q5_1,
Q6_K to Q8_0, and Q2_K/Q3_K to Q4_0 (llama.cpp now picks IQ4_NL, which Taper lacks); a row
length 32 does not divide stays in float. Start-up lists every tensor that fell back.
"""
from __future__ import annotations

import logging
import re

import numpy as np
from tqdm import tqdm

from engine.quant import ISQ_TYPES, QT, quantize

log = logging.getLogger("taper.loader")

_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                         r"\.weight$")
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.Q4_0,
             QT.Q3_K: QT.Q4_0}
_BLOCK = {t: (256 if t in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K) else 32)
          for t in ISQ_TYPES.values()}


def isq_type(name: str) -> QT:
    """The ggml type for an --isq value, or ValueError listing the choices."""
    if name.lower() not in ISQ_TYPES:
        raise ValueError(f"--isq {name}: unknown type; choose from {', '.join(ISQ_TYPES)}")
    return ISQ_TYPES[name.lower()]


def type_for(qtype: QT, k: int) -> QT | None:
    """The type a row of k elements gets: qtype, its fallback, or None (stays float)."""
    if k % _BLOCK[qtype] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if k % _BLOCK[qtype] == 0 else None


def quantize_weights(weights: dict, isq: str, progress: bool = True) -> None:
    """Replace the projection matrices in `weights` (Hugging Face names) by QuantizedWeights."""
    want = isq_type(isq)
    # float matrices only: a GGUF's blocks or a GPTQ/AWQ/FP8 checkpoint's packed weights stay
    names = [n for n in weights if _PROJECTION.match(n) and isinstance(weights[n], np.ndarray)]
    fell_back: dict[str, str] = {}
    for name in tqdm(names, desc=f"quantizing to {want.name}", unit="tensor",
                     disable=not progress):
        k = weights[name].shape[1]
        qtype = type_for(want, k)
        if qtype != want:
            fell_back[name] = qtype.name if qtype is not None else "float (kept)"
        if qtype is not None:
            weights[name] = quantize(weights[name], qtype)
    if fell_back:
        log.warning("--isq %s: %d tensors have rows %s's block does not divide and fell back: %s",
                    isq, len(fell_back), want.name,
                    ", ".join(f"{n} -> {t}" for n, t in fell_back.items()))
    log.info("--isq %s: quantized %d projection matrices", isq, len(names))
