"""FP8 (OCP e4m3) weights as the model graph sees them, and the FP8 KV cache's scales.

An `Fp8Weight` stands where a float (N, K) matrix would: it has `.shape`, and the CPU backend's
`linear` calls its `cpu_linear`, which runs pyx/fp8_kernels.c on the 1-byte codes with the block
scales applied inside the kernel (activations stay f32). One layout covers every FP8 checkpoint
flavour: codes (N, K) and one f32 scale per (bn x bk) block --
  block-wise (quant_method fp8 with weight_block_size, DeepSeek-V3 / Qwen3-FP8): bn x bk = 128 x 128,
  per-channel (compressed-tensors strategy "channel"): bn = 1, bk = K,
  per-tensor (strategy "tensor", quant_method fp8 without blocks): stored per channel, so that
  q/k/v or gate/up with different scales fuse by stacking rows.
The raw tensors stay as they are (codes are the checkpoint's F8_E4M3 bytes, scales its numbers) for
the GPU issue's CUTLASS path; `kind` says which flavour they came from.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger("taper.loader")


@dataclass(slots=True)
class Fp8Weight:
    weight: np.ndarray                  # (N, K) uint8: e4m3 codes
    scale: np.ndarray                   # (N // bn, ceil(K / bk)) float32: value = decode(code) * scale
    block: tuple[int, int]              # (bn, bk)
    kind: str = "block"                 # "block" | "channel" (per-tensor scales are stored per channel)
    input_scale: np.ndarray | None = None  # static activation scales, one per fused part (not used on CPU)

    def __post_init__(self):
        if self.weight.dtype.name == "float8_e4m3fn":
            self.weight = self.weight.view(np.uint8)
        if self.weight.dtype != np.uint8 or self.weight.ndim != 2:
            raise ValueError(f"FP8 weight codes must be a uint8 or float8_e4m3fn matrix, got "
                             f"{self.weight.dtype} {self.weight.shape}")
        self.weight = np.ascontiguousarray(self.weight)
        self.scale = np.ascontiguousarray(self.scale, dtype=np.float32)
        n, k = self.weight.shape
        bn, bk = self.block
        if n % bn or self.scale.shape != (n // bn, -(-k // bk)):
            raise ValueError(f"FP8 weight {self.weight.shape} with block {self.block} needs scales "
                             f"{(n // bn, -(-k // bk))}, got {self.scale.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @classmethod
    def concat(cls, weights: list["Fp8Weight"]) -> "Fp8Weight":
        """Stack along N (q/k/v, gate/up): codes and scale rows stack as they are, since every
        part's N is a multiple of its row block."""
        first = weights[0]
        for w in weights[1:]:
            if w.block != first.block or w.shape[1] != first.shape[1] or w.kind != first.kind:
                raise ValueError("FP8 weights to fuse need the same K, block and kind: "
                                 + ", ".join(f"{w.shape} {w.block} {w.kind}" for w in weights))
        inputs = [w.input_scale for w in weights]
        input_scale = (None if any(s is None for s in inputs)
                       else np.concatenate([np.ravel(s) for s in inputs]).astype(np.float32))
        return cls(np.concatenate([w.weight for w in weights]),
                   np.concatenate([w.scale for w in weights]), first.block, first.kind, input_scale)

    def cpu_linear(self, backend, x, bias, out):
        from pyx.fp8 import fp8_linear
        fp8_linear(backend.isa, x, self.weight, self.scale, self.block, bias, out,
                   backend.num_threads, getattr(backend, "batch_invariant", False))

    def dequantize(self) -> np.ndarray:
        """(N, K) float32 (tests, debugging)."""
        import ml_dtypes
        bn, bk = self.block
        n, k = self.shape
        s = np.repeat(np.repeat(self.scale, bn, 0), bk, 1)[:n, :k]
        return (self.weight.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).astype(np.float32)


# ---- FP8 KV cache scales

# Per layer, (K name, V name) under "model.layers.{i}.", as checkpoints spell them (vLLM's
# maybe_remap_kv_scale_name and compressed-tensors' get_cache_scale): llm-compressor / HF, ModelOpt,
# compressed-tensors' older kv_cache_scheme and Quark, and the deprecated single kv_scale (used
# for both, as vLLM does).
KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


def _head_scales(name: str, value, num_kv_heads: int) -> np.ndarray:
    s = np.asarray(value, dtype=np.float32).ravel()
    if s.size == 1:
        s = np.repeat(s, num_kv_heads)
    if s.size != num_kv_heads:
        raise ValueError(f"KV cache scale {name} has {s.size} values; expected 1 or one per KV "
                         f"head ({num_kv_heads})")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"KV cache scale {name} must be finite and positive, got {s.tolist()}")
    return np.array(s, dtype=np.float32)  # an owned copy, not a view of the file


def take_kv_scales(weights: dict, layer: int, num_kv_heads: int):
    """Pops layer `layer`'s K and V cache scales from the weight dict: ((Hkv,), (Hkv,)) float32, or
    None when the checkpoint has none (the FP8 cache then uses 1.0)."""
    prefix = f"model.layers.{layer}."
    found = None
    for k_name, v_name in KV_SCALE_NAMES:
        k = weights.pop(prefix + k_name, None)
        v = k if v_name == k_name else weights.pop(prefix + v_name, None)
        if k is None and v is None:
            continue
        if k is None or v is None:
            raise ValueError(f"checkpoint has {prefix + (k_name if k is not None else v_name)} "
                             f"but not {prefix + (v_name if k is not None else k_name)}")
        if found is None:
            found = (_head_scales(prefix + k_name, k, num_kv_heads),
                     _head_scales(prefix + v_name, v, num_kv_heads))
    return found
