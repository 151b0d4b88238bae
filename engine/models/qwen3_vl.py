"""Qwen3-VL, dense (Qwen3's language model) and MoE (Qwen3-MoE's): Qwen2.5-VL's M-RoPE and image
rows (engine/models/qwen2_5_vl.py) with the frequencies interleaved, its vision tower
(engine/vision/qwen3_vl_encoder.py), and DeepStack: the tower's j-th DeepStack feature added to
the image tokens' hidden states after language-model layer j (transformers'
Qwen3VLTextModel._deepstack_process), for the first len(deepstack_visual_indexes) layers.

A step's image rows carry their features in the columns past the hidden size (the encoder's
output, engine/vision/qwen3_vl_encoder.py); a DeepStack layer adds its columns to those rows of
`residual` after its own forward: with the layers' residual convention (pyx/layers.pyx) the
layer's output is residual + hidden, so adding to either is adding to the output.
"""
from __future__ import annotations

import numpy as np

from engine.models.moe import MoeForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.vision import act_arrays
from engine.vision.qwen3_vl_encoder import Qwen3VisionEncoder
from pyx.layers import DecoderLayer


class DeepstackDecoderLayer(DecoderLayer):
    """A decoder layer, then its DeepStack feature (columns first_column .. + hidden of the
    step's image embeddings) added to the image rows."""

    def __init__(self, backend, *args, first_column: int):
        super().__init__(backend, *args)
        # (DecoderLayer's backend is not visible here)
        self.to_backend, self.xp = backend.asarray, backend.xp
        self.first_column = first_column

    def forward(self, batch, hidden, residual, k_cache, v_cache, ws):
        super().forward(batch, hidden, residual, k_cache, v_cache, ws)
        vb = batch.vision
        if vb is not None:
            H = residual.shape[1]
            rows = self.to_backend(vb.rows)
            act_arrays.add_rows(self.xp, residual, rows,
                                vb.embeds[:, self.first_column:self.first_column + H])


def _stacked_experts(weights: dict, first: int = 0) -> None:
    """In place: each layer's stacked experts (mlp.experts.gate_up_proj, down_proj) as the
    per-expert tensors engine/models/moe.py reads. The hub's files hold gate_up (E, H, 2I) and
    down (E, I, H); transformers 5 saves its own layout, (E, 2I, H) and (E, H, I); as its
    loader (Transpose with check_dims), the in-memory layout is taken as is when the shapes
    allow both. first: the first stacked expert's number (under expert parallel a rank holds
    experts first.. only, engine/parallel/sharding.py)."""
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        base = name[:-len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        if gate_up.ndim != 3 or down.ndim != 3 or down.shape[0] != gate_up.shape[0]:
            raise ValueError(f"{name} {list(gate_up.shape)} and {base}down_proj "
                             f"{list(down.shape)} are not stacks of one count of experts")
        E, a, b = gate_up.shape
        # in memory (E, 2I, H) with down (E, H, I); else the files' (E, H, 2I) with (E, I, H)
        if down.shape == (E, b, a // 2) and a % 2 == 0:
            inter = a // 2
        elif down.shape == (E, b // 2, a) and b % 2 == 0:
            gate_up = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
            down = np.ascontiguousarray(down.transpose(0, 2, 1))
            inter = b // 2
        else:
            raise ValueError(f"{name} {list(gate_up.shape)} does not match {base}down_proj "
                             f"{list(down.shape)}")
        for e in range(E):
            weights[f"{base}{first + e}.gate_proj.weight"] = gate_up[e, :inter]
            weights[f"{base}{first + e}.up_proj.weight"] = gate_up[e, inter:]
            weights[f"{base}{first + e}.down_proj.weight"] = down[e]


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    vision_tower_class = Qwen3VisionEncoder

    def _layer(self, weights: dict, p: str, i: int, attn, mlp):
        c = self.config
        # i counts from a pipeline stage's first layer; the DeepStack features go by the
        # layer's place in the whole model (engine/parallel/stages_vision.py)
        layer = i + (c.pipeline.first_layer if c.pipeline is not None else 0)
        if layer >= len(c.vision.deepstack_visual_indexes):
            return super()._layer(weights, p, i, attn, mlp)
        return DeepstackDecoderLayer(
            self.backend, attn, mlp, self._norm(weights, f"{p}input_layernorm.weight"),
            self._norm(weights, f"{p}post_attention_layernorm.weight"), c.rms_norm_eps, i == 0,
            first_column=(layer + 1) * c.hidden_size)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, MoeForCausalLM):
    """The same with Qwen3-MoE's sparse layers (engine/models/moe.py)."""

    def __init__(self, config, weights: dict, backend):
        tp = config.tensor_parallel
        self._first_expert = tp.experts[0] if tp is not None and tp.experts else 0
        super().__init__(config, weights, backend)

    def _checkpoint_names(self, weights: dict) -> None:
        Qwen2_5_VLForConditionalGeneration._checkpoint_names(weights)
        _stacked_experts(weights, self._first_expert)

