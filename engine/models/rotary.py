"""RoPE cos/sin cache: (max_positions, rot_dim) float32, cos in the first rot_dim/2 columns, sin in
the last rot_dim/2 (the layout the rotary_embedding op reads).

LongRoPE (Phi-3) has two sets of frequencies: the short factors while a sequence fits the original
context, the long ones beyond it. Its cache holds both, short rows then long rows, and
`longrope_positions` sends each token to its sequence's set: a sequence whose context exceeds the
original length reads the long rows for all of its new tokens. That is transformers' rule (the
set is chosen per forward pass by the longest position), so a prompt longer than the original
context is computed with the long factors throughout, and keys cached before a sequence grows past
it keep the short ones, as they do in transformers' KV cache.

inv_freq follows transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py) per rope type, except
"dynamic", which is applied statically as vLLM does: the base is scaled once for the stretched
context max_position_embeddings * factor. Everything is computed in float64 and cast at the end.
"""
from __future__ import annotations

import math

import numpy as np

from engine.models.model_config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq (rot_dim/2,) float64, cos/sin multiplier)."""
    dim = rope.rot_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    base = rope.theta
    kind = rope.rope_type
    if kind == "default":
        return 1.0 / base ** exponents, 1.0
    if kind == "linear":
        return 1.0 / base ** exponents / rope.factor, 1.0
    if kind == "dynamic":
        max_len = max_position_embeddings * rope.factor
        base = base * ((rope.factor * max_len / max_position_embeddings) - (rope.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** exponents, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(rope, 1.0 / base ** exponents), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rope, base ** exponents), _yarn_attention_factor(rope)
    if kind == "longrope":  # the short set; build_cos_sin_cache adds the long one
        return 1.0 / (np.asarray(rope.short_factor) * base ** exponents), _longrope_attention_factor(rope)
    raise ValueError(f"unsupported rope type {kind!r}")


def _llama3_inv_freq(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
    return get_mscale(rope.factor)


def _longrope_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def _yarn_inv_freq(rope: RopeConfig, pos_freqs: np.ndarray) -> np.ndarray:
    dim, base, orig = rope.rot_dim, rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations):
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def build_cos_sin_cache(rope: RopeConfig, max_position_embeddings: int,
                        max_positions: int) -> np.ndarray:
    """(max_positions, rot_dim) float32: [cos | sin] of position * inv_freq, times the scale;
    for LongRoPE (2 * max_positions, rot_dim), the short set's rows then the long set's."""
    inv_freq, scale = inv_freq_and_scale(rope, max_position_embeddings)
    cache = _cos_sin(inv_freq, scale, max_positions)
    if rope.rope_type != "longrope":
        return cache
    exponents = np.arange(0, rope.rot_dim, 2, dtype=np.float64) / rope.rot_dim
    long_inv_freq = 1.0 / (np.asarray(rope.long_factor) * rope.theta ** exponents)
    return np.concatenate([cache, _cos_sin(long_inv_freq, scale, max_positions)])


def _cos_sin(inv_freq: np.ndarray, scale: float, max_positions: int) -> np.ndarray:
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles) * scale, np.sin(angles) * scale], axis=1).astype(np.float32)


def longrope_positions(xp, positions, query_start_loc, seq_lens, original_max_len: int,
                       max_positions: int):
    """Rows of a LongRoPE cache for a batch's tokens (module docstring): each position, plus
    max_positions where its sequence's context exceeds original_max_len. NumPy or CuPy arrays."""
    token_seq = xp.searchsorted(query_start_loc[1:], xp.arange(len(positions)), side="right")
    token_seq = xp.minimum(token_seq, len(seq_lens) - 1)  # padding rows past the last sequence
    long = (seq_lens > original_max_len).astype(positions.dtype)
    return positions + long[token_seq] * max_positions
