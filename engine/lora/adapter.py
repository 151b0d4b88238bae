"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, as
`PeftModel.save_pretrained` writes it) read into host arrays and checked against the base model.

Each targeted linear W gets PEFT's delta: y = W x + scaling * B (A x), A (r, in) and B (out, r),
scaling = alpha / r, or alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern override r
and alpha per module, matched as PEFT matches them. The scaling is folded into B^T here, so a slot
holds A and scaling * B^T and the kernels multiply nothing else.

Targets: the attention's q/k/v/o and the MLP's gate/up/down projections of each layer. An adapter on
the embeddings or the LM head, a fused checkpoint projection (qkv_proj, gate_up_proj), DoRA, LoRA
biases and the other PEFT variants are refused with a LoraError naming the adapter and what it
asks for, as is a tensor whose shape does not fit the base model or a rank above --max-lora-rank.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from engine.loader.safetensors import CheckpointError, open_file
from engine.models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# A layer's module (as PEFT names it under model.layers.N.) -> (the fused projection of the graph
# that computes it, its part there). Parts are column ranges of the fused output, in order.
MODULES = {
    "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2), "self_attn.o_proj": ("o", 0),
    "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", 0),
}
# Base-model modules whose adapters change something else than a linear's output.
REFUSED_TARGETS = {"embed_tokens": "the token embeddings", "lm_head": "the LM head"}

# adapter_config.json settings beyond plain LoRA: key -> (value that means "off", what it is)
UNSUPPORTED_SETTINGS = {
    "use_dora": (False, "DoRA (use_dora)"),
    "lora_bias": (False, "LoRA biases (lora_bias)"),
    "use_qalora": (False, "QALoRA (use_qalora)"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens)"),
    "trainable_token_indices": (None, "trainable token embeddings (trainable_token_indices)"),
    "layer_replication": (None, "layer replication (layer_replication)"),
    "target_parameters": (None, "LoRA on parameters (target_parameters)"),
    "fan_in_fan_out": (False, "fan_in_fan_out (GPT-2 style Conv1D weights)"),
}

_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)


class LoraError(ValueError):
    """An adapter that cannot be served: its message names the adapter and the problem."""


@dataclass(slots=True)
class LoraPart:
    """One targeted module: its part of a fused projection, A (r, in) and scaling * B^T (r, out),
    float32."""
    part: int
    a: np.ndarray
    bt: np.ndarray

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True, eq=False, weakref_slot=True)
class LoraAdapter:
    name: str
    path: str
    rank: int                     # the largest rank of its modules
    # (layer, projection) -> the parts it targets there
    deltas: dict[tuple[int, str], list[LoraPart]] = field(default_factory=dict)
    # unique for each adapter loaded: keys the prefix cache and the slots, so a name unloaded and
    # loaded again with other weights never reuses the old one's KV blocks or slot
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.bt.nbytes for parts in self.deltas.values() for p in parts)


def module_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each module an adapter may target, from the base config."""
    H, I = c.hidden_size, c.intermediate_size
    return {"self_attn.q_proj": (H, c.q_size), "self_attn.k_proj": (H, c.kv_size),
            "self_attn.v_proj": (H, c.kv_size), "self_attn.o_proj": (c.q_size, H),
            "mlp.gate_proj": (H, I), "mlp.up_proj": (H, I), "mlp.down_proj": (I, H)}


def pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first
    pattern that matches the end of the module's full name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def read_adapter(name: str, path: str, model_config: ModelConfig, max_rank: int,
                 projections: dict[int, set[str]], shard=None) -> LoraAdapter:
    """The adapter in directory `path`, checked against the base model: every tensor's shape,
    its rank (at most max_rank), and that the base graph has the projection it targets
    (projections: layer -> the projections its graph can add a delta to; a mixture-of-experts
    layer has no dense MLP). shard: a split engine's rank (engine/lora/shards.py AdapterShard)
    keeps its share only, checked as the whole adapter first; its layers and projections are
    then the rank's."""
    def fail(problem: str):
        raise LoraError(f"LoRA adapter {name!r} ({path}): {problem}")

    if not os.path.isdir(path):
        fail("no such directory")
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        fail(f"{CONFIG_FILE} is missing (a PEFT adapter directory has {CONFIG_FILE} and "
             f"{WEIGHTS_FILE})")
    if not os.path.isfile(weights_path):
        other = " (adapter_model.bin is a pickle: save with safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        fail(f"{WEIGHTS_FILE} is missing{other}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:
        fail(f"{CONFIG_FILE} is not valid JSON ({e})")
    if not isinstance(config, dict):
        fail(f"{CONFIG_FILE} is not a JSON object")
    _check_config(config, fail)

    try:
        tensors = open_file(weights_path)
    except CheckpointError as e:
        fail(str(e))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        refused = next((what for target, what in REFUSED_TARGETS.items()
                        if f"{target}." in key or key.startswith(target)), None)
        if refused is not None or "lora_embedding_" in key:
            fail(f"it adapts {refused or 'the token embeddings'} (tensor {key}); only the "
                 f"attention and MLP projections can take LoRA adapters here")
        m = _TENSOR.match(key)
        if m is None:
            fail(f"tensor {key} is not a LoRA A or B weight of a decoder layer's projection")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in MODULES:
            fail(f"tensor {key} targets {module}, which this base has no LoRA support for "
                 f"(supported: {', '.join(sorted(m.split('.')[1] for m in MODULES))})")
        if not 0 <= layer < model_config.num_hidden_layers:
            fail(f"tensor {key} is for layer {layer}; the base model has "
                 f"{model_config.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = tensor

    shapes = module_shapes(model_config)
    alpha_default, r_default = config.get("lora_alpha", 8), config.get("r", 8)
    adapter = LoraAdapter(name, path, 0)
    for (layer, module), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            fail(f"{where} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out \
                or a.shape[0] != b.shape[1]:
            fail(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base "
                 f"model's {module} ({fan_in} in, {fan_out} out: expected lora_A [r, {fan_in}] "
                 f"and lora_B [{fan_out}, r]); is it an adapter for another base model?")
        r = a.shape[0]
        if r > max_rank:
            fail(f"{where} has rank {r}, above --max-lora-rank {max_rank}")
        projection, part = MODULES[module]
        r_config = pattern_value(config.get("rank_pattern"), where, r_default)
        if r_config != r:
            fail(f"{where} has rank {r}, but adapter_config.json gives it r = {r_config}")
        local = layer if shard is None else shard.layer(layer)
        if local is None:           # another pipeline stage's layer
            continue
        if projection not in projections.get(local, ()):
            fail(f"{where}: layer {layer} of this base model has no {projection} projection "
                 "that takes LoRA adapters (a mixture of experts, latent or linear attention)")
        alpha = pattern_value(config.get("alpha_pattern"), where, alpha_default)
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        if shard is not None:
            a, b = shard.cut(layer, module, a, b)
        bt = (np.asarray(b, np.float64).T * scaling).astype(np.float32)
        adapter.deltas.setdefault((local, projection), []).append(
            LoraPart(part, np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(bt)))
        adapter.rank = max(adapter.rank, r)
    if not pairs:
        fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return adapter


def _check_config(config: dict, fail) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        fail(f"peft_type is {peft_type!r}; only LoRA adapters are served")
    for key, (off, what) in UNSUPPORTED_SETTINGS.items():
        value = config.get(key, off)
        if value != off and value not in (None, False, [], {}):
            fail(f"{what} is not supported")
    if config.get("bias", "none") != "none":
        fail(f"bias={config['bias']!r} (trained biases) is not supported; only bias=\"none\"")
    if config.get("modules_to_save"):
        fail(f"modules_to_save {config['modules_to_save']} (fully trained copies of base "
             "modules) is not supported")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in names:
        for base_name, what in REFUSED_TARGETS.items():
            if base_name in target:
                fail(f"target_modules includes {target!r}: it adapts {what}; only the "
                     "attention and MLP projections can take LoRA adapters here")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            fail(f"{key} must be a positive number, got {value!r}")
