"""Offline conversion of a GPTQ, AWQ or compressed-tensors int4 checkpoint to the Marlin format:

    python -m engine.tools.convert_marlin SRC_DIR DST_DIR

The checkpoint is loaded the way the engine loads it (engine/loader/quant_formats.py: every int4
layer becomes an Int4Weight), each int4 layer is repacked by pyx/weights/marlin.py's CPU reference,
and DST_DIR gets one model.safetensors with the Marlin tensors (engine/loader/quant_marlin.py
documents them) and every other tensor as stored, a config.json whose quantization_config is
{"quant_method": "marlin", ...}, and SRC_DIR's other files (tokenizer, generation config).
Layers are converted one by one, as stored: no q/k/v or gate/up fusion (the model does that).
Checkpoints with FP8 layers are refused (the Marlin format holds int4 only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np
from safetensors.numpy import save_file

from engine.loader.quant_formats import convert_quantized
from engine.loader.quant_marlin import LAYOUT
from engine.loader.safetensors import load_safetensors
from pyx.weights.int4 import Int4Weight
from pyx.weights.marlin import repack_int4

INT4_METHODS = ("gptq", "awq", "compressed-tensors")


def convert(src: str, dst: str, progress: bool = False) -> dict:
    """Writes the Marlin checkpoint of src to dst; returns its quantization_config."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") not in INT4_METHODS:
        raise ValueError(f"{src}: quantization_config.quant_method {qc.get('quant_method')!r} "
                         f"cannot be converted; supported: {', '.join(INT4_METHODS)}")
    weights = load_safetensors(src, dtype="auto", progress=progress, quantized=True)
    convert_quantized(weights, qc)
    out = {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight):
            layer = name[:-len(".weight")]
            m = repack_int4(w)
            out[f"{layer}.marlin_qweight"] = m.qweight
            out[f"{layer}.scales"] = m.scales
            if m.zeros is not None:
                out[f"{layer}.marlin_zeros"] = m.zeros
            out[f"{layer}.marlin_shape"] = np.array([m.n, m.k, m.group_size], np.int64)
        elif isinstance(w, np.ndarray):
            out[name] = np.ascontiguousarray(w)
        else:
            raise ValueError(f"{src}: layer {name} is {type(w).__name__}, not int4; only int4 "
                             "checkpoints convert to Marlin")
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    new_qc = {"quant_method": "marlin", "bits": 4, "layout": LAYOUT,
              "converted_from": qc.get("quant_method")}
    config["quantization_config"] = new_qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and entry != "config.json" and not entry.endswith(
                (".safetensors", ".safetensors.index.json")):
            shutil.copy2(path, os.path.join(dst, entry))
    return new_qc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.convert_marlin",
                                     description="Convert a GPTQ, AWQ or compressed-tensors "
                                     "int4 checkpoint to the Marlin format.")
    parser.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("dst", help="output directory")
    args = parser.parse_args(argv)
    convert(args.src, args.dst, progress=sys.stderr.isatty())
    print(f"wrote {os.path.join(args.dst, 'model.safetensors')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
