"""FP8 checkpoints -> Fp8Weight (pyx/weights/fp8.py), in place in the weight dict.

Two producers, one weight object (OCP e4m3 codes plus one f32 scale per block of rows x columns):

- `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8, transformers' FineGrainedFP8Config): with
  `weight_block_size` [bn, bk], each layer has `weight` F8_E4M3 (N, K) and `weight_scale_inv`
  (N / bn, K / bk) f32, the multiplier that dequantizes (despite its name). Without
  `weight_block_size` (vLLM's original Fp8Config), `weight_scale` is per tensor.
  `activation_scheme: static` adds an `input_scale` per layer.
  `modules_to_not_convert` / `ignored_layers` name layers stored in float (lm_head, typically).
- compressed-tensors `float-quantized` (llm-compressor FP8 W8A8 / W8A16): `weight` F8_E4M3 with
  `weight_scale` per channel (N, 1), per tensor, or per block (strategy "block" with
  `block_structure`); activations dynamic per token, or static with an `input_scale`.

The CPU backend computes with f32 activations, so static input scales are kept on the weight (for
the GPU path) but not applied on the CPU; a log line says so. Start-up errors name what is not
supported: e5m2 weights, a static activation scheme whose input scales are missing, a block size
that does not divide a weight's shape, other bit widths or strategies.
The FP8 KV cache's k_scale / v_scale tensors are left for the model
(engine.models.kv_scales.take_kv_scales).
"""
from __future__ import annotations

import logging
import re

import ml_dtypes
import numpy as np

from pyx.weights.fp8 import Fp8Weight

logger = logging.getLogger("taper.loader")

F8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                 np.dtype(np.float64))


def _fp8_layers(weights: dict) -> list[str]:
    """Prefixes of layers whose `.weight` is stored in FP8; e5m2 is a start-up error."""
    e5m2 = [n for n, a in weights.items() if getattr(a, "dtype", None) == F8_E5M2]
    if e5m2:
        raise ValueError(f"FP8 e5m2 weights are not supported (only e4m3): {e5m2[0]}"
                         + (f" and {len(e5m2) - 1} more" if len(e5m2) > 1 else ""))
    return [n[:-len(".weight")] for n, a in weights.items()
            if n.endswith(".weight") and getattr(a, "dtype", None) == F8_E4M3]


def _pop_scale(weights: dict, name: str, what: str) -> np.ndarray:
    s = weights.pop(name, None)
    if s is None:
        raise ValueError(f"{name[:name.rindex('.')]}.weight is FP8 but the checkpoint has no {name} "
                         f"({what})")
    if getattr(s, "dtype", None) not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {getattr(s, 'dtype', type(s).__name__)}, expected a "
                         "float scale")
    return np.asarray(s, dtype=np.float32)


def block_shape(value, what: str) -> tuple[int, int]:
    """[rows, cols] of an FP8 scale block, from a config's list or "128x128"."""
    if isinstance(value, str):  # older compressed-tensors wrote "128x128"
        value = value.lower().split("x")
    try:
        bn, bk = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be two positive integers [rows, cols], got {value!r}") from None
    if bn < 1 or bk < 1:
        raise ValueError(f"{what} must be two positive integers [rows, cols], got {value!r}")
    return bn, bk


def _block_weight(prefix: str, codes, scale: np.ndarray, block: tuple[int, int], what: str):
    n, k = codes.shape
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"{what} {list(block)} does not divide {prefix}.weight's shape {[n, k]}: "
                         "FP8 blocks that do not divide the weight are not supported")
    if scale.size != (n // bn) * (k // bk):
        raise ValueError(f"{prefix}.weight {[n, k]} with blocks {list(block)} needs "
                         f"{[n // bn, k // bk]} scales, got shape {list(scale.shape)}")
    return Fp8Weight(codes, np.ascontiguousarray(scale.reshape(n // bn, k // bk)), block, "block")


def _channel_weight(prefix: str, codes, scale: np.ndarray, per_tensor_ok: bool = True,
                    per_channel_ok: bool = True):
    """Per-tensor (1 value) or per-channel (N values) scales, stored per channel."""
    n, k = codes.shape
    if scale.size == 1 and per_tensor_ok:
        scale = np.full((n, 1), float(scale.ravel()[0]), np.float32)
    elif scale.size == n and per_channel_ok:
        scale = np.ascontiguousarray(scale.reshape(n, 1))
    else:
        want = " or ".join(w for w, ok in (("1 (per tensor)", per_tensor_ok),
                                           (f"{n} (per channel)", per_channel_ok)) if ok)
        raise ValueError(f"{prefix}.weight_scale has shape {list(scale.shape)}; expected {want} values")
    return Fp8Weight(codes, scale, (1, k), "channel")


def _codes(weights: dict, prefix: str):
    codes = weights.pop(prefix + ".weight")
    if codes.ndim != 2:
        raise ValueError(f"{prefix}.weight is FP8 with shape {list(codes.shape)}; only matrices "
                         "can be FP8")
    return codes.view(np.uint8)


def _check_no_leftovers(weights: dict, suffixes: tuple[str, ...], hint: str):
    left = [n for n in weights if n.endswith(suffixes)]
    if left:
        raise ValueError(f"{left[0]} belongs to no FP8 weight ({hint})"
                         + (f"; {len(left) - 1} more like it" if len(left) > 1 else ""))


def _log_static(static_layers: int):
    if static_layers:
        logger.info("FP8: static input_scale of %d layers kept for the GPU path; the CPU backend "
                    "computes with f32 activations, so it ignores them", static_layers)


def convert_fp8_block(weights: dict, quantization_config: dict) -> None:
    """quant_method "fp8": block-wise (weight_block_size) or per-tensor FP8 e4m3 weights."""
    qc = quantization_config
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"quantization_config fmt {fmt!r}: FP8 {fmt} weights are not supported "
                         "(only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config activation_scheme {scheme!r} is not supported "
                         "(dynamic or static)")
    block = qc.get("weight_block_size")
    block = None if block is None else block_shape(block, "weight_block_size")
    not_convert = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
    prefixes = _fp8_layers(weights)
    if not prefixes:
        raise ValueError("quant_method fp8, but the checkpoint has no F8_E4M3 weights (were they "
                         "converted to float at load?)")
    static = 0
    for prefix in prefixes:
        listed = [m for m in not_convert if m and m in prefix]
        if listed:
            raise ValueError(f"{prefix}.weight is FP8 but modules_to_not_convert lists {listed[0]!r}")
        codes = _codes(weights, prefix)
        if block is not None:
            scale = _pop_scale(weights, prefix + ".weight_scale_inv", "block scales")
            w = _block_weight(prefix, codes, scale, block, "weight_block_size")
        else:
            scale = _pop_scale(weights, prefix + ".weight_scale", "per-tensor scale")
            w = _channel_weight(prefix, codes, scale, per_channel_ok=False)
        input_scale = weights.pop(prefix + ".input_scale", None)
        if scheme == "static":
            if input_scale is None:
                raise ValueError(f"activation_scheme static needs {prefix}.input_scale, which the "
                                 "checkpoint lacks (static FP8 activations without input scales "
                                 "are not supported)")
            w.input_scale = np.asarray(input_scale, np.float32).ravel()
            static += 1
        weights[prefix + ".weight"] = w
    _check_no_leftovers(weights, (".weight_scale_inv", ".weight_scale", ".input_scale"),
                        "its weight is not FP8")
    _log_static(static)


# ---- compressed-tensors float-quantized


def _get(obj, key, default=None):
    """Scheme fields from a dict (config.json) or an object with attributes (parsed configs)."""
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _ct_matches(prefix: str, targets) -> bool:
    """compressed-tensors target / ignore matching: "Linear" (every linear layer, which is what
    an FP8 matrix is), "re:<regex>" (re.match on the layer name) or a layer name (or its tail)."""
    for t in targets or []:
        if t == "Linear":
            return True
        if t.startswith("re:"):
            if re.match(t[3:], prefix):
                return True
        elif prefix == t or prefix.endswith("." + t):
            return True
    return False


def _float_schemes(quantization_config: dict) -> list:
    groups = quantization_config.get("config_groups") or {}
    return [g for g in groups.values() if _get(_get(g, "weights") or {}, "type") == "float"]


def convert_compressed_fp8(weights: dict, quantization_config: dict, scheme=None,
                           layers=None) -> None:
    """compressed-tensors float-quantized FP8: each matching layer's weight, weight_scale (and
    input_scale, weight_zero_point) become one Fp8Weight under `....weight`.

    scheme: the config group (dict from config.json, or an object with the same attribute names:
    weights, input_activations, targets); None = every float group of the config in turn.
    layers: layer prefixes to convert; None = the F8 layers that the group's targets match and the
    config's `ignore` does not."""
    if scheme is None:
        schemes = _float_schemes(quantization_config)
        if not schemes:
            raise ValueError("compressed-tensors config has no float-quantized config group")
        for s in schemes:
            convert_compressed_fp8(weights, quantization_config, s, layers)
        return
    wargs = _get(scheme, "weights") or {}
    bits, wtype = _get(wargs, "num_bits"), _get(wargs, "type")
    if wtype != "float" or bits != 8:
        raise ValueError(f"compressed-tensors weights {bits}-bit {wtype}: only 8-bit float (FP8 "
                         "e4m3) is handled by the FP8 path")
    strategy = _get(wargs, "strategy") or "tensor"
    strategy = str(getattr(strategy, "value", strategy))  # an enum in parsed configs
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not supported "
                         "(tensor, channel, block)")
    if _get(wargs, "symmetric", True) is False:
        raise ValueError("compressed-tensors asymmetric FP8 weights are not supported")
    if _get(wargs, "dynamic", False) is True:
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    block = block_shape(_get(wargs, "block_structure"), "block_structure") if strategy == "block" else None
    acts = _get(scheme, "input_activations")
    static = False
    if acts:
        abits, atype = _get(acts, "num_bits"), _get(acts, "type")
        if atype != "float" or abits != 8:
            raise ValueError(f"compressed-tensors input activations {abits}-bit {atype} with FP8 "
                             "weights are not supported (8-bit float or none)")
        static = not _get(acts, "dynamic", True)
    if layers is None:
        targets = _get(scheme, "targets") or ["Linear"]
        ignore = quantization_config.get("ignore") or []
        layers = [p for p in _fp8_layers(weights)
                  if _ct_matches(p, targets) and not _ct_matches(p, ignore)]
    else:
        _fp8_layers(weights)  # e5m2 check
    nstatic = 0
    for prefix in layers:
        w = weights.get(prefix + ".weight")
        if getattr(w, "dtype", None) != F8_E4M3:
            raise ValueError(f"{prefix}.weight is {getattr(w, 'dtype', 'missing')}, but its "
                             "compressed-tensors group is FP8 (float-quantized e4m3)")
        codes = _codes(weights, prefix)
        scale = _pop_scale(weights, prefix + ".weight_scale", f"{strategy} scales")
        zp = weights.pop(prefix + ".weight_zero_point", None)
        if zp is not None and np.any(np.asarray(zp) != 0):
            raise ValueError(f"{prefix}.weight_zero_point is nonzero: asymmetric FP8 weights are "
                             "not supported")
        if block is not None:
            fw = _block_weight(prefix, codes, scale, block, "block_structure")
        else:
            fw = _channel_weight(prefix, codes, scale, per_tensor_ok=strategy == "tensor",
                                 per_channel_ok=strategy == "channel")
        input_scale = weights.pop(prefix + ".input_scale", None)
        weights.pop(prefix + ".input_zero_point", None)
        if static:
            if input_scale is None:
                raise ValueError(f"static FP8 input activations need {prefix}.input_scale, which "
                                 "the checkpoint lacks")
            fw.input_scale = np.asarray(input_scale, np.float32).ravel()
            nstatic += 1
        weights[prefix + ".weight"] = fw
    _log_static(nstatic)
