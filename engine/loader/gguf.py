"""GGUF files (llama.cpp's format) as a Hugging Face config, weights and tokenizer.

`read_gguf(path)` reads one file, or every shard of a gguf-split model given its first shard
(`name-00001-of-00003.gguf`), through gguf.GGUFReader (the file memory-mapped):

- config: a config.json-style dict for ModelConfig.from_dict, from the `{arch}.*` metadata. llama
  files are LlamaForCausalLM (MistralForCausalLM when they carry a sliding window, and
  MixtralForCausalLM when they carry `llama.expert_count`), qwen2 and qwen3 files
  Qwen2/Qwen3ForCausalLM (qwen2vl and qwen3vl files too, the VL models' language models: with a
  --mmproj file Qwen2.5-VL and Qwen3-VL, engine/loader/gguf_mmproj.py; qwen3vlmoe as qwen3moe),
  qwen2moe and qwen3moe files Qwen2Moe/Qwen3MoeForCausalLM, mistral3 files MistralForCausalLM
  (Mistral 3's language model), and the
  gemma2, gemma3, phi3, glm4 and stablelm files their families (the keys, names and converter
  transforms of each: engine/loader/gguf_dense.py), deepseek2 files DeepseekV2/V3ForCausalLM
  (engine/loader/gguf_deepseek.py), qwen3next, qwen35 and qwen35moe files
  Qwen3NextForCausalLM and Qwen3_5(Moe)ForCausalLM (engine/loader/gguf_hybrid.py). A llama3
  RoPE is stored as the per-frequency factors it produces (tensor rope_freqs), so its
  parameters are recovered from them.
- weights: Hugging Face names. F32/F16/BF16 tensors are float arrays, views of the mapping unless
  converted (the dtype policy of engine/loader/safetensors.py). Block-quantized tensors stay
  packed as QuantizedWeight (ggml blocks, one row of blocks per output row).
- experts: the converter stacks each layer's experts into one tensor per projection,
  `blk.N.ffn_{gate,up,down}_exps` of shape (E, rows, cols) (or gate and up in one
  `ffn_gate_up_exps`, E, 2I, H); each expert becomes its Hugging Face matrix, a view of its slice
  (float) or of its rows of blocks (ggml types), so the experts keep the file's quant type and
  `backend.linear` runs them as it runs dense weights. Routing follows llama.cpp's graphs: the top
  k probabilities are renormalised for llama (Mixtral) and qwen3moe, not for qwen2moe, unless
  the file says otherwise (`{arch}.expert_weights_norm`).
- tokenizer: engine.tokenizer.Tokenizer rebuilt from the tokenizer.ggml.* metadata
  (engine/text/gguf_tokenizer.py), or None when the file has none we can rebuild.

llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj/k_proj (weights and biases) for the
llama architecture, within each head, from Hugging Face's rotate-half layout to the interleaved
pairs llama.cpp's RoPE rotates: HF row `j * head_dim/2 + i` of a head is stored as row `2i + j`.
We undo it, so the graph keeps the rotate-half RoPE. Rows are independent in every block format,
so on quantized tensors the same permutation moves whole rows of blocks.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from tqdm import tqdm

from engine.loader import gguf_deepseek, gguf_dense, gguf_hybrid
from engine.loader.gguf_check import check_layout, read_version
from engine.loader.safetensors import resolve_dtype, target_dtype
from engine.text.gguf_tokenizer import build_tokenizer, special_id
from pyx.weights.ggml import BLOCK_TYPES, QuantizedWeight

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

logger = logging.getLogger("taper.loader")

# general.architecture -> (Hugging Face architecture, model_type)
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
          "qwen3": ("Qwen3ForCausalLM", "qwen3"),
          # Qwen2-VL / 2.5-VL's language model: text positions make M-RoPE plain RoPE (with
          # --mmproj, Qwen2.5-VL: engine/loader/gguf_mmproj.py)
          "qwen2vl": ("Qwen2ForCausalLM", "qwen2"),
          # Qwen3-VL's language model likewise (with --mmproj: engine/loader/gguf_mmproj_qwen3vl.py)
          "qwen3vl": ("Qwen3ForCausalLM", "qwen3"),
          "qwen3vlmoe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
          # Mistral 3's language model (Mistral Small 3.1: with --mmproj,
          # engine/loader/gguf_mmproj_pixtral.py); llama's layout, q/k permuted
          "mistral3": ("MistralForCausalLM", "mistral"),
          "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
          "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), **gguf_dense.ARCHS,
          gguf_deepseek.ARCH: ("DeepseekV2ForCausalLM", "deepseek_v2"), **gguf_hybrid.ARCHS}
# Whether llama.cpp's graph renormalises the top-k routing weights (build_moe_ffn's norm_w).
_MOE_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "qwen3next": True,
             "qwen35moe": True, "qwen3vlmoe": True}
_PERMUTED_QK = ("llama", "mistral3")    # architectures whose q/k rows the converter interleaves

_FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16, QT.F64})

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# merged expert tensor -> the per-expert projections it holds, stacked along its rows
_EXPERT_TENSORS = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",),
                   "ffn_down_exps": ("down_proj",), "ffn_gate_up_exps": ("gate_proj", "up_proj")}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(slots=True)
class GGUFCheckpoint:
    config: dict                                        # Hugging Face config.json-style
    weights: dict[str, np.ndarray | QuantizedWeight]    # Hugging Face names
    tokenizer: Tokenizer | None
    files: list[str] = field(default_factory=list)      # the shards read, in order


def hf_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor name in a file of `arch` (unknown names pass
    through)."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _LAYER_RE.match(name)
    if m:
        names = (gguf_hybrid.LAYER_NAMES if arch in gguf_hybrid.ARCHS
                 else gguf_dense.LAYER_NAMES.get(arch, {}))
        hf = names.get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
        if hf:
            return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    return name


def expert_names(name: str, num_experts: int, mixtral: bool) -> list[list[str]] | None:
    """For a merged expert tensor, the Hugging Face names of each expert's projections in the
    order they are stacked along each expert's rows ([[gate, up], ...] for ffn_gate_up_exps);
    None for any other tensor."""
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _EXPERT_TENSORS or m.group(3) != "weight":
        return None
    block = "block_sparse_moe" if mixtral else "mlp"
    return [[f"model.layers.{m.group(1)}.{block}.experts.{e}."
             f"{_MIXTRAL_NAMES[p] if mixtral else p}.weight" for p in _EXPERT_TENSORS[m.group(2)]]
            for e in range(num_experts)]


def split_experts(path: str, t, want: np.dtype | None, names: list[list[str]]) -> dict:
    """A merged expert tensor (ReaderTensor, E x rows x cols) as {Hugging Face name: that
    expert's matrix}, each a view of the file's data: a float array (dtype policy) or its rows of
    ggml blocks."""
    dims = [int(d) for d in t.shape]                    # GGUF order: (cols, rows, E)
    if len(dims) != 3 or dims[2] != len(names):
        raise ValueError(f"{path}: tensor {t.name} has dims {dims}; expected (cols, rows, "
                         f"{len(names)}) for {len(names)} experts")
    quantized = t.tensor_type in BLOCK_TYPES
    data = t.data.reshape(dims[2], dims[1], -1) if quantized else _tensor(path, t, want)
    out = {}
    for e, projections in enumerate(names):
        for name, rows in zip(projections, np.split(data[e], len(projections), axis=0)):
            out[name] = QuantizedWeight.of(int(t.tensor_type), rows, dims[0]) if quantized \
                else rows
    return out


def vocab_ids(meta: dict, tokens: dict[str, str], path: str) -> dict[str, int]:
    """{key: id} of each named token in a GGUF's vocabulary (tokenizer.ggml.tokens); a token
    the vocabulary lacks is a ValueError naming it."""
    vocab = meta.get("tokenizer.ggml.tokens") or []
    ids = {}
    for key, token in tokens.items():
        if token not in vocab:
            raise ValueError(f"{path}: the vocabulary has no {token} token")
        ids[key] = vocab.index(token)
    return ids


def unpermute_rows(w, num_heads: int):
    """Undo convert_hf_to_gguf.py's LlamaModel.permute along axis 0 (rows, or rows of blocks)."""
    n = w.shape[0]
    if n % (2 * num_heads):
        raise ValueError(f"{n} rows do not split into {num_heads} heads of pairs")
    half = n // num_heads // 2
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# ---- files

def open_reader(path: str) -> GGUFReader:
    """A GGUFReader whose tensors all lie inside the file; ValueError naming the file and what is
    wrong with it otherwise (the magic, the version, or the metadata key or tensor that is cut:
    engine/loader/gguf_check.py)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ValueError(f"{path}: cannot open GGUF file ({e.strerror})") from None
    if head[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    read_version(path, head)
    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError,
            MemoryError) as e:
        check_layout(path)          # raises, naming the key or tensor that does not fit
        raise ValueError(f"{path}: corrupt GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: truncated GGUF file: tensor {t.name} needs bytes "
                             f"[{t.data_offset}, {end}) but the file has {size}")
    return reader


def field_value(field):
    """A metadata value as Python data (strings, numbers, bools, lists). Float32 scalars come back
    as the shortest decimal that rounds to them (1e-06, not 9.999999974752427e-07), which is
    what the converter was given."""
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


def read_metadata(reader: GGUFReader) -> dict:
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def shard_paths(path: str, metadata: dict) -> list[str]:
    """Every shard of the model `path` belongs to, first to last (just [path] when unsplit)."""
    count = int(metadata.get("split.count", 1) or 1)
    if count <= 1:
        return [path]
    directory, base = os.path.split(path)
    m = _SHARD_RE.match(base)
    if m is None or int(m.group("count")) != count:
        raise ValueError(f"{path}: split.count is {count} but the name does not follow "
                         f"NAME-00001-of-{count:05d}.gguf, so the other shards cannot be found")
    paths = [os.path.join(directory, f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{path}: shard {missing[0]} of this {count}-file model is missing")
    return paths


# ---- config

class _Meta:
    """`{arch}.*` metadata lookups that name the file and key when a required one is missing."""

    def __init__(self, path: str, metadata: dict, arch: str):
        self.path, self.metadata, self.arch = path, metadata, arch

    def get(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {self.arch}.{key} is missing")
        return value

    def uniform(self, key: str, default=None):
        """A per-model value that llama.cpp also allows per layer (an array): all equal here."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{self.path}: {self.arch}.{key} differs between layers "
                                 f"({value}); not supported")
            value = value[0]
        return value


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    """The rope_freqs values convert_hf_to_gguf.py writes for these llama3 parameters."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _short(x: float, digits: int = 5) -> float:
    """x to `digits` significant digits: 8.000001 (float32 noise) -> 8.0."""
    x = float(x)
    return x if x == 0 else round(x, digits - 1 - math.floor(math.log10(abs(x))))


def llama3_rope(path: str, factors: np.ndarray, theta: float, dim: int) -> dict:
    """llama3 rope parameters that reproduce `factors` (one per rotated pair of dims).

    The factors are 1 for short wavelengths, `factor` for long ones and, in between, a curve that
    is linear in 1/wavelength with slope original/(high-low) and intercept -low/(high-low). Two
    numbers fix three parameters, so we take low_freq_factor = 1 (every Llama 3.x release) and
    keep the result only if it reproduces the file's factors."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.size != dim // 2:
        raise ValueError(f"{path}: rope_freqs has {factors.size} values for {dim} rotated dims")
    factor = _short(factors.max())
    candidates = []
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if mid.sum() >= 2 and factor > 1:
        s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        x = theta ** (-np.arange(0, dim, 2) / dim)[mid] / (2 * math.pi)     # 1 / wavelength
        slope, intercept = np.polyfit(x, s, 1)
        if intercept < 0 < slope:
            low = 1.0
            candidates.append((int(round(-slope * low / intercept)), low,
                               _short(low - low / intercept)))
    candidates.append((8192, 1.0, 4.0))     # Llama 3.1's, when no factor lies on the curve
    for original, low, high in candidates:
        if np.allclose(_llama3_factors(theta, dim, factor, low, high, original), factors,
                       rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"{path}: cannot recover llama3 RoPE parameters from rope_freqs "
                     f"(factors {np.round(factors, 4).tolist()})")


def _rope_scaling(path: str, meta: _Meta, rope_freqs, theta: float, rot_dim: int) -> dict | None:
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if kind is None and meta.get("rope.scale_linear") is not None:     # older files
        kind, factor = "linear", meta.get("rope.scale_linear")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ValueError(f"{path}: both rope_freqs and rope.scaling.type {kind!r}; "
                             "not supported")
        return llama3_rope(path, rope_freqs, theta, rot_dim)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = meta.get("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                          ("rope.scaling.yarn_beta_slow", "beta_slow"),
                          ("rope.scaling.yarn_attn_factor", "attention_factor"),
                          ("rope.scaling.attn_factor", "attention_factor")):
            if meta.get(key) is not None:
                scaling[name] = float(meta.get(key))
        ext = meta.get("rope.scaling.yarn_ext_factor")
        if ext is not None and ext not in (-1.0, 1.0):
            raise ValueError(f"{path}: yarn_ext_factor {ext} is not supported (only 1)")
        return scaling
    raise ValueError(f"{path}: unsupported RoPE scaling {kind!r}; supported: linear, yarn, "
                     "llama3 (rope_freqs)")


def build_config(path: str, metadata: dict, tensors: dict) -> dict:
    """config.json-style dict from the metadata; `tensors` maps GGUF names to ReaderTensors."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(_ARCHS)}")
    meta = _Meta(path, metadata, arch)
    if arch == "mistral3" and (meta.get("attention.temperature_scale") is not None
                               or meta.get("rope.scaling.yarn_log_multiplier") is not None):
        raise ValueError(f"{path}: a mistral3 file with YaRN's log multiplier or an attention "
                         "temperature scale (Ministral 3) is not supported; Mistral Small 3.x "
                         "files are")
    architecture, model_type = _ARCHS[arch]
    hidden = int(meta.require("embedding_length"))
    num_layers = int(meta.require("block_count"))
    num_heads = int(meta.uniform("attention.head_count") or 0)
    if not num_heads:
        raise ValueError(f"{path}: metadata key {arch}.attention.head_count is missing")
    num_kv_heads = int(meta.uniform("attention.head_count_kv") or num_heads)
    head_dim = int(meta.get("attention.key_length") or hidden // num_heads)
    value_dim = int(meta.get("attention.value_length") or head_dim)
    if value_dim != head_dim and arch != gguf_deepseek.ARCH:   # MLA: the latent's sizes
        raise ValueError(f"{path}: key_length {head_dim} != value_length {value_dim}; "
                         "not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])    # GGUF dims are (H, V)
    theta = float(meta.get("rope.freq_base") or 10000.0)
    rot_dim = int(meta.get("rope.dimension_count") or head_dim)
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        rope_freqs = np.asarray(rope_freqs.data, dtype=np.float32)

    config = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": int(meta.uniform("feed_forward_length")
                                                        or meta.require("feed_forward_length")),
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon") or 1e-6),
        "max_position_embeddings": int(meta.get("context_length") or 2048),
        "vocab_size": vocab_size, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(path, meta, rope_freqs, theta, rot_dim),
    }
    if rot_dim != head_dim:
        config["partial_rotary_factor"] = rot_dim / head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors

    num_experts = int(meta.get("expert_count") or 0)
    if arch == gguf_deepseek.ARCH:
        config = gguf_deepseek.config(path, meta, tensors, config)
    elif num_experts:
        config.update(_moe_config(path, meta, tensors, num_layers, num_experts))
    if arch in gguf_hybrid.ARCHS:
        config = gguf_hybrid.config(path, meta, tensors, config)

    window = int(meta.get("attention.sliding_window") or 0)
    if arch in gguf_dense.ARCHS:
        gguf_dense.family_config(path, meta, tensors, config, rot_dim)
    elif window:
        if arch == "llama" and num_experts:
            config["sliding_window"] = window       # Mixtral: one window on every layer
        elif arch == "llama":     # Mistral: one window on every layer
            config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                          sliding_window=window)
        else:
            pattern = meta.get("attention.sliding_window_pattern")
            if isinstance(pattern, list) and len(pattern) == num_layers:
                layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                layer_types = ["sliding_attention"] * num_layers
            config.update(use_sliding_window=True, sliding_window=window, layer_types=layer_types)

    float_types = {tensors[n].tensor_type for n in tensors
                   if len(tensors[n].shape) >= 2 and tensors[n].tensor_type in _FLOAT_TYPES}
    config["dtype"] = ("bfloat16" if QT.BF16 in float_types else
                       "float16" if QT.F16 in float_types else "float32")

    def token_id(key):
        return special_id(metadata, key, [])

    config["bos_token_id"] = token_id("bos_token_id")
    eos = [i for i in (token_id("eos_token_id"), token_id("eot_token_id"),
                       token_id("eom_token_id")) if i is not None]
    eos = list(dict.fromkeys(eos))
    config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    if token_id("padding_token_id") is not None:
        config["pad_token_id"] = token_id("padding_token_id")
    return config


def _moe_config(path: str, meta: _Meta, tensors: dict, num_layers: int,
                num_experts: int) -> dict:
    """The Mixtral / Qwen2-MoE / Qwen3-MoE keys of config.json. A layer without a router
    (ffn_gate_inp) has a dense MLP, which transformers' Qwen MoE configs call mlp_only_layers."""
    arch = meta.arch
    if arch not in _MOE_NORM:
        raise ValueError(f"{path}: {arch}.expert_count is set but Taper runs experts only for "
                         f"{', '.join(_MOE_NORM)} files")
    top_k = int(meta.require("expert_used_count"))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{path}: {arch}.expert_used_count {top_k} is not in 1..{num_experts}")
    gating = meta.get("expert_gating_func")
    if gating not in (None, 1):                 # llama.cpp: 1 = softmax
        raise ValueError(f"{path}: {arch}.expert_gating_func {gating} is not supported "
                         "(only softmax, 1)")
    scale = meta.get("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"{path}: {arch}.expert_weights_scale {scale} is not supported")
    normalize = bool(meta.get("expert_weights_norm", _MOE_NORM[arch]))
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers)]
    if arch == "llama":
        if not all(sparse):
            raise ValueError(f"{path}: a Mixtral file needs experts (ffn_gate_inp) in every layer")
        if not normalize:
            raise ValueError(f"{path}: Mixtral always renormalises its top-k weights; "
                             "llama.expert_weights_norm is false")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": num_experts, "num_experts_per_tok": top_k}
    moe_ff = int(meta.get("expert_feed_forward_length") or 0)
    if not moe_ff:
        first = next((i for i, s in enumerate(sparse) if s), None)
        gate = tensors.get(f"blk.{first}.ffn_down_exps.weight")
        if gate is None:
            raise ValueError(f"{path}: metadata key {arch}.expert_feed_forward_length is missing")
        moe_ff = int(gate.shape[0])             # down: (I, H, E) in GGUF order
    shared = tensors.get("blk.%d.ffn_down_shexp.weight" % next(
        (i for i, s in enumerate(sparse) if s), 0))
    shared_ff = int(meta.get("expert_shared_feed_forward_length") or
                    (shared.shape[0] if shared is not None else 0))
    if arch in ("qwen3moe", "qwen3vlmoe") and shared_ff:
        raise ValueError(f"{path}: qwen3moe with a shared expert is not supported")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": moe_ff, "shared_expert_intermediate_size": shared_ff,
            "norm_topk_prob": normalize, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, s in enumerate(sparse) if not s]}


# ---- tensors

def _tensor(path: str, t, want: np.dtype | None):
    """A GGUF tensor as a float array (dtype policy) or a QuantizedWeight (packed)."""
    qtype = t.tensor_type
    if qtype in _FLOAT_TYPES:
        arr = t.data
        if qtype == QT.BF16:    # GGUFReader hands BF16 out as raw bytes
            arr = arr.view(ml_dtypes.bfloat16)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = arr.reshape(shape)
        target = target_dtype(arr, want)
        return arr if arr.dtype == target else arr.astype(target)
    if qtype in BLOCK_TYPES:
        if len(t.shape) != 2:     # (merged experts are split by split_experts first)
            raise ValueError(f"{path}: tensor {t.name} is {qtype.name} with "
                             f"{len(t.shape)} dims; only matrices can be block-quantized")
        k, n = (int(d) for d in t.shape)
        return QuantizedWeight.of(int(qtype), t.data.reshape(n, -1), k)
    raise ValueError(f"{path}: tensor {t.name} has type {qtype.name}, which Taper does not "
                     f"support (supported: F32, F16, BF16, "
                     f"{', '.join(sorted(q.name for q in BLOCK_TYPES))})")


def _unpermute(weight, num_heads: int):
    if isinstance(weight, QuantizedWeight):
        ((qtype, blocks),) = weight.quant_parts
        return QuantizedWeight.of(qtype, unpermute_rows(blocks, num_heads), weight.k)
    return unpermute_rows(weight, num_heads)


def read_gguf(path: str, dtype: str = "auto", progress: bool = True,
              deferred: bool = False) -> GGUFCheckpoint:
    """Config, weights (Hugging Face names) and tokenizer of a GGUF model (module docstring).
    deferred: deepseek2's kv_b_proj as gguf_deepseek.KvB, read by gguf_deepseek.read_deferred
    once a rank has cut it (engine/loader/model_loader.py)."""
    want = resolve_dtype(dtype)
    path = os.fspath(path)
    first = open_reader(path)
    metadata = read_metadata(first)
    if int(metadata.get("split.no", 0) or 0) != 0:
        m = _SHARD_RE.match(os.path.basename(path))
        if m is None:
            raise ValueError(f"{path}: shard {metadata['split.no'] + 1} of a split model; "
                             "give the first shard")
        path = os.path.join(os.path.dirname(path),
                            f"{m.group('stem')}-00001-of-{m.group('count')}.gguf")
        first = open_reader(path)
        metadata = read_metadata(first)
    paths = shard_paths(path, metadata)
    readers = [first] + [open_reader(p) for p in paths[1:]]

    tensors, owner = {}, {}
    for i, (p, reader) in enumerate(zip(paths, readers)):
        no = reader.fields.get("split.no")
        if len(paths) > 1 and (no is None or int(field_value(no)) != i):
            raise ValueError(f"{p}: expected shard {i + 1} of {len(paths)} "
                             f"(split.no {None if no is None else field_value(no)})")
        for t in reader.tensors:
            if t.name in tensors:
                raise ValueError(f"tensor {t.name} appears in both {owner[t.name]} and {p}")
            tensors[t.name], owner[t.name] = t, p
    expected = metadata.get("split.tensors.count")
    if len(paths) > 1 and expected is not None and int(expected) != len(tensors):
        raise ValueError(f"{path}: split.tensors.count is {expected} but the shards hold "
                         f"{len(tensors)} tensors")

    config = build_config(path, metadata, tensors)
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    logger.info("loading %s: %s, %d tensors (%s), %.2f GB", path, config["architectures"][0],
                len(tensors), ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
                sum(t.n_bytes for t in tensors.values()) / 1e9)
    arch = metadata["general.architecture"]
    permute = arch in _PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    num_experts = int(config.get("num_local_experts") or config.get("num_experts")
                      or config.get("n_routed_experts") or 0)
    mixtral = config["architectures"][0] == "MixtralForCausalLM"

    weights = {}
    with tqdm(total=len(tensors), desc="Loading weights", unit="tensor",
              disable=not progress or None, leave=False) as bar:
        for name, t in tensors.items():
            bar.update(1)
            if name == "rope_freqs.weight" or name in gguf_dense.CONFIG_TENSORS:
                continue                        # folded into config["rope_scaling"]
            if arch in gguf_hybrid.ARCHS:
                if gguf_hybrid.is_nextn(name, config["num_hidden_layers"]):
                    continue                    # the MTP layers: unused
                if gguf_hybrid.is_delta_net(name):
                    weights.update(gguf_hybrid.delta_net_weight(name,
                                                                gguf_hybrid.float_tensor(t)))
                    continue
            experts = expert_names(name, num_experts, mixtral) if num_experts else None
            if experts is not None:
                weights.update(split_experts(owner[name], t, want, experts))
                continue
            if arch == gguf_deepseek.ARCH:
                weights.update(gguf_deepseek.hf_weights(name, t if gguf_deepseek.is_kv_b(name)
                                                        else _tensor(owner[name], t, want)))
                continue
            weight = _tensor(owner[name], t, want)
            m = _LAYER_RE.match(name)
            if permute and m and m.group(2) in heads:
                weight = _unpermute(weight, heads[m.group(2)])
            hf = hf_name(name, arch)
            if mixtral:
                hf = hf.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            if hf.endswith("shared_expert_gate.weight"):    # a vector in the file, (1, H) in HF
                weight = weight.reshape(1, -1)
            weights.update(gguf_dense.hf_weights(arch, name, hf, weight))

    if arch == gguf_deepseek.ARCH:
        gguf_deepseek.join_kv_b(weights, deferred)
    if arch in gguf_hybrid.ARCHS:
        gguf_hybrid.finish(arch, config, weights)
    tokenizer = build_tokenizer(metadata, path)
    return GGUFCheckpoint(config=config, weights=weights, tokenizer=tokenizer, files=paths)
