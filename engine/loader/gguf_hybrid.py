"""GGUF `qwen3next`, `qwen35` and `qwen35moe` files (Qwen3-Next, Qwen3.5 dense and MoE: gated
DeltaNet beside gated full attention) as llama.cpp's convert_hf_to_gguf.py writes them
(conversion/qwen.py) and llama.cpp reads them back, as the config and the Hugging Face tensors of
engine/models/qwen3_next.py.

What the converter changes, put back here:
- The DeltaNet's sizes are written as Mamba's keys: ssm.conv_kernel (linear_conv_kernel_dim),
  ssm.state_size (linear_key_head_dim), ssm.group_count (linear_num_key_heads),
  ssm.time_step_rank (linear_num_value_heads), ssm.inner_size (value heads x value head size);
  the layer kinds as attention.recurrent_layers (one flag per layer, true = linear).
- Every RMSNorm weight but the DeltaNet's gated one gets + 1 (the family multiplies by 1 + w):
  we subtract it (exact in float32 for the weights' range: Sterbenz), so the model's own
  norm_offset applies again.
- A_log is stored as ssm_a = -exp(A_log) and read back as log(-ssm_a); dt_bias is ssm_dt.bias;
  the convolution (C, 1, K) is squeezed to (C, K).
- Qwen3-Next: in_proj_qkvz, grouped per key head [q k v z], is split into attn_qkv ([q k v],
  each in head order) and attn_gate (z), which we regroup; in_proj_ba is ssm_ba as it was.
- Qwen3.5: in_proj_qkv / z / b / a are attn_qkv, attn_gate, ssm_beta, ssm_alpha, but where there
  are more value heads than key heads the converter reorders every value-head axis (v's rows in
  attn_qkv and the convolution, z, b, a, A_log, dt_bias, out_proj's columns) from grouped by key
  head (g0v0 g0v1 .. g1v0 ..) to tiled (g0v0 g1v0 .. g0v1 ..) for ggml's broadcast; undone here.
- Multi-token-prediction layers (nextn_predict_layers) are counted in block_count; they are not
  read (the model does not use them; the converter's --no-mtp leaves them out).
The DeltaNet tensors are read as float32 whatever the file's type (dequantized: the
regrouping moves single rows and columns, and the model places them in float). Routing follows
llama.cpp's graphs, which renormalise the top k for all three (engine/loader/gguf.py _MOE_NORM).
llama.cpp reads the key and value head sizes of the DeltaNet as one (ssm.state_size), so a file
whose sizes differ is refused by name.
"""
from __future__ import annotations

import re

import numpy as np
from gguf import quants

# general.architecture -> (Hugging Face architecture, model_type)
ARCHS = {"qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
         "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
         "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}

# GGUF layer tensor -> Hugging Face name, where these families differ from the llama-style table
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
               "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
               "ssm_ba": "linear_attn.in_proj_ba", "ssm_beta": "linear_attn.in_proj_b",
               "ssm_alpha": "linear_attn.in_proj_a", "ssm_a": "linear_attn.A_log",
               "ssm_dt": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d",
               "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
_DELTA_NET = frozenset(LAYER_NAMES) - {"post_attention_norm"}
# the norms the converter stores as 1 + w
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 ".self_attn.q_norm.weight", ".self_attn.k_norm.weight")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_SSM_A_RE = re.compile(r"^blk\.(\d+)\.ssm_a$")      # the converter writes it without a suffix
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def config(path: str, meta, tensors: dict, base: dict) -> dict:
    """In place over `base` (the keys every architecture shares, and the MoE keys): the DeltaNet
    sizes and the layer kinds of a qwen3next / qwen35 / qwen35moe file."""
    def need(key):
        value = meta.require(key)
        return int(value)

    nextn = int(meta.get("nextn_predict_layers") or 0)
    layers = base["num_hidden_layers"] - nextn
    nk, nv = need("ssm.group_count"), need("ssm.time_step_rank")
    dk, inner = need("ssm.state_size"), need("ssm.inner_size")
    if nv == 0 or inner % nv:
        raise ValueError(f"{path}: {meta.arch}.ssm.inner_size {inner} is not a multiple of "
                         f"ssm.time_step_rank {nv}")
    dv = inner // nv
    if dv != dk:
        raise ValueError(f"{path}: the DeltaNet's value head size {dv} (ssm.inner_size / "
                         f"ssm.time_step_rank) differs from its key head size {dk} "
                         "(ssm.state_size); llama.cpp reads both as ssm.state_size")
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ValueError(f"{path}: {meta.arch}.attention.recurrent_layers has "
                             f"{len(recurrent)} flags for {layers} layers")
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    else:
        interval = int(meta.get("full_attention_interval") or 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(layers)]
    base.update(num_hidden_layers=layers, layer_types=layer_types,
                linear_conv_kernel_dim=need("ssm.conv_kernel"), linear_key_head_dim=dk,
                linear_value_head_dim=dv, linear_num_key_heads=nk, linear_num_value_heads=nv)
    if "mlp_only_layers" in base:     # the MoE keys of engine/loader/gguf.py's _moe_config
        base["mlp_only_layers"] = [i for i in base["mlp_only_layers"] if i < layers]
    return base


def is_delta_net(name: str) -> bool:
    """Whether GGUF tensor `name` is a DeltaNet tensor (read as float32, then regrouped)."""
    if _SSM_A_RE.match(name):
        return True
    m = _LAYER_RE.match(name)
    return m is not None and m.group(2) in _DELTA_NET


def is_nextn(name: str, num_layers: int) -> bool:
    """Whether GGUF tensor `name` belongs to a multi-token-prediction layer (a block past the
    model's layers: its decoder tensors and its blk.N.nextn.* ones)."""
    m = _BLOCK_RE.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def float_tensor(t) -> np.ndarray:
    """A GGUF tensor (any type gguf-py reads) as float32 in numpy's dimension order."""
    data = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
    return data.reshape([int(d) for d in reversed(t.shape.tolist())])


def delta_net_weight(name: str, weight: np.ndarray) -> dict:
    """{Hugging Face name: value} of a DeltaNet tensor as the file holds it (the regrouping
    waits for finish(), which needs the config)."""
    m = _SSM_A_RE.match(name)
    if m:
        return {f"model.layers.{m.group(1)}.linear_attn.A_log": np.log(-weight)}
    layer, kind, suffix = _LAYER_RE.match(name).groups()
    hf = f"model.layers.{layer}.{LAYER_NAMES[kind]}"
    return {hf if kind == "ssm_dt" else f"{hf}.{suffix}": weight}


def _to_grouped(w: np.ndarray, axis: int, nk: int, nv: int, d: int) -> np.ndarray:
    """Undo conversion/qwen.py's _reorder_v_heads along `axis`: value heads (each d long) from
    tiled order (r blocks of nk) back to grouped by key head (nk blocks of r)."""
    r = nv // nk
    shape = list(w.shape)
    tiled = w.reshape(shape[:axis] + [r, nk, d] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(tiled, axis, axis + 1).reshape(shape))


def finish(arch: str, config: dict, weights: dict) -> None:
    """In place, once every tensor is read: the norms' + 1 taken off, the convolutions given
    back their middle axis, and each DeltaNet projection regrouped as the checkpoint holds it."""
    for name in [n for n in weights if n.endswith(_OFFSET_NORMS) or n == "model.norm.weight"]:
        weights[name] = np.asarray(weights[name], np.float32) - np.float32(1.0)
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    key_dim = nk * dk
    for i, kind in enumerate(config["layer_types"]):
        if kind != "linear_attention":
            continue
        p = f"model.layers.{i}.linear_attn."
        conv = weights[f"{p}conv1d.weight"]
        weights[f"{p}conv1d.weight"] = conv.reshape(conv.shape[0], 1, conv.shape[-1])
        if arch == "qwen3next":
            _regroup_qkvz(weights, p, nk, nv, dk, dv)
        elif nk != nv:
            _ungroup_value_heads(weights, p, nk, nv, key_dim, dv)


def _regroup_qkvz(weights: dict, p: str, nk: int, nv: int, dk: int, dv: int) -> None:
    """attn_qkv ([q k v], each in head order) and attn_gate (z) as Qwen3-Next's in_proj_qkvz,
    rows per key head [q (dk), k (dk), v (r dv), z (r dv)]."""
    qkv, z = weights.pop(f"{p}in_proj_qkv.weight"), weights.pop(f"{p}in_proj_z.weight")
    H, r = qkv.shape[1], nv // nk
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    weights[f"{p}in_proj_qkvz.weight"] = np.ascontiguousarray(np.concatenate(
        [q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, r * dv, H),
         z.reshape(nk, r * dv, H)], axis=1).reshape(-1, H))


def _ungroup_value_heads(weights: dict, p: str, nk: int, nv: int, key_dim: int,
                         dv: int) -> None:
    """Qwen3.5's value-head axes from the converter's tiled order back to grouped."""
    for name, d in (("in_proj_z.weight", dv), ("in_proj_b.weight", 1), ("in_proj_a.weight", 1),
                    ("A_log", 1), ("dt_bias", 1)):
        weights[p + name] = _to_grouped(weights[p + name], 0, nk, nv, d)
    for name, axis in (("in_proj_qkv.weight", 0), ("conv1d.weight", 0)):
        w = weights[p + name]
        qk, v = w[:2 * key_dim], w[2 * key_dim:]
        weights[p + name] = np.concatenate([qk, _to_grouped(v, axis, nk, nv, dv)])
    weights[p + "out_proj.weight"] = _to_grouped(weights[p + "out_proj.weight"], 1, nk, nv, dv)
