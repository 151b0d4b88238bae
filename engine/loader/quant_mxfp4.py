"""MXFP4 checkpoints (quant_method "mxfp4": every released GPT-OSS) dequantized at load, in place
in the weight dict, as transformers' integrations/mxfp4.py (convert_moe_packed_tensors) does.

A quantized tensor `X` is stored as two uint8 tensors:
- `X_blocks` (E, R, G, 16): for each of the E experts and each of the R output rows, G blocks of
  32 FP4 E2M1 codes along the input dimension, two a byte: the low nibble is the even element,
  the high nibble the odd one; a code's top bit is its sign (pyx/mxfp4_kernels.c decodes them);
- `X_scales` (E, R, G): one E8M0 exponent per block, biased by 127: the block's values are
  code * 2**(scale - 127).
The dequantized matrix (E, R, 32 G) is transposed to (E, 32 G, R), the layout GPT-OSS's float
checkpoints store its experts in (gate_up_proj (E, H, 2I), down_proj (E, I, H)), so the model
reads both kinds alike. It takes the dtype the loader gave the checkpoint's other float matrices
(bf16 for the released files with dtype auto); each value is exact in bf16, f16 aside.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from engine.loader.safetensors import mem_available_bytes
from pyx import mxfp4
from pyx.cpu_threads import usable_cpus

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def convert_mxfp4(weights: dict, quantization_config: dict) -> None:
    """Every `*_blocks` / `*_scales` pair replaced by its dequantized tensor under the name
    without the suffix."""
    names = [n for n in weights if n.endswith("_blocks")]
    if not names:
        raise ValueError("quant_method mxfp4, but the checkpoint has no *_blocks tensors "
                         "(was it dequantized already? then drop quantization_config)")
    dtype = _float_dtype(weights)
    _check_memory(weights, names, dtype)
    for name in names:
        base = name[:-len("_blocks")]
        if base + "_scales" not in weights:
            raise ValueError(f"{name}: MXFP4 blocks without their scales ({base}_scales)")
        if base in weights:
            raise ValueError(f"{base}: both a float tensor and MXFP4 blocks in the checkpoint")
        weights[base] = dequantize_mxfp4(weights.pop(name), weights.pop(base + "_scales"),
                                         dtype, base)
    stray = [n for n in weights if n.endswith("_scales")]
    if stray:
        raise ValueError(f"{stray[0]}: MXFP4 scales without their blocks "
                         f"({stray[0][:-len('_scales')]}_blocks)")


def dequantize_mxfp4(blocks, scales, dtype, name: str = "tensor") -> np.ndarray:
    """blocks (E, R, G, 16) uint8 and scales (E, R, G) uint8 -> (E, 32 G, R) in dtype, by the C
    kernel on every usable CPU (a NumPy pass took 0.26 s per GPT-OSS-20B expert: minutes for the
    120B)."""
    return mxfp4.dequantize(blocks, scales, dtype, name, usable_cpus()[0])


def _check_memory(weights: dict, names: list, dtype) -> None:
    """The loader's memory check counted the packed bytes; dequantized they take 4x (bf16)."""
    needed = sum(np.asarray(weights[n]).size * 2 * np.dtype(dtype).itemsize for n in names)
    available = mem_available_bytes()
    if available is not None and needed > available:
        raise MemoryError(f"dequantizing the MXFP4 experts needs {needed / 1e9:.2f} GB, "
                          f"{available / 1e9:.2f} GB available (the weights do not fit in "
                          f"memory as {np.dtype(dtype).name})")


def _float_dtype(weights: dict) -> np.dtype:
    """The dtype the loader gave the checkpoint's float matrices (the embedding's, typically)."""
    for w in weights.values():
        if isinstance(w, np.ndarray) and w.ndim >= 2 and w.dtype in _FLOAT_DTYPES:
            return w.dtype
    return np.dtype(np.float32)
