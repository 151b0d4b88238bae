"""Checkpoints quantized by other tools (config.json `quantization_config`) to weights the backend
computes on, in place in the weight dict.

Each format's converter replaces a layer's raw tensors (for example GPTQ's qweight, qzeros,
scales, g_idx) by one weight object under the layer's `.weight` name: a packed format of
pyx/weights/ (Int4Weight, Fp8Weight) with `.shape` (N, K), which the backends' `linear`
recognises; it keeps the raw tensors for the GPU issue's repacking (Marlin, CUTLASS FP8). A
variant a converter does not handle is a start-up error that names it.
"""
from __future__ import annotations

from engine.loader.quant_compressed import convert_compressed_tensors
from engine.loader.quant_fp8 import convert_fp8_block
from engine.loader.quant_int4 import convert_gptq_awq
from engine.loader.quant_marlin import convert_marlin
from engine.loader.quant_mxfp4 import convert_mxfp4


def convert_quantized(weights: dict, quantization_config: dict) -> None:
    method = quantization_config.get("quant_method")
    if method in ("gptq", "awq"):
        convert_gptq_awq(weights, quantization_config)
    elif method == "compressed-tensors":
        convert_compressed_tensors(weights, quantization_config)
    elif method == "marlin":
        convert_marlin(weights, quantization_config)
    elif method == "fp8":
        convert_fp8_block(weights, quantization_config)
    elif method == "mxfp4":     # dequantized: GPT-OSS's experts in the checkpoint's float dtype
        convert_mxfp4(weights, quantization_config)
    else:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         "supported: gptq, awq, compressed-tensors, fp8, marlin, mxfp4 (and GGUF "
                         "files, --isq)")
