"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama graph with a mixture-of-experts block (pyx/moe.py)
in place of the MLP on the layers the config makes sparse.

Only the names differ between the families: Mixtral keeps its experts under
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down), the Qwen models under
`mlp.experts.{e}.gate_proj/up_proj/down_proj`, with Qwen2-MoE's shared expert under
`mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`. MiniMax-M2
(engine/models/minimax_m2.py) keeps Mixtral's names and adds a sigmoid router's
`e_score_correction_bias` (MoeConfig.grouped).

Under expert parallel (engine/parallel/sharding.py) a rank holds experts [start, stop) whole: the
router stays whole (every rank routes every token the same way) and the block's output is the
rank's experts' share of the weighted sum, which the all-reduce after it completes.
"""
from __future__ import annotations

import numpy as np

from engine.models.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, expected_shapes
from pyx.layers import MLP
from pyx.moe import MoE


def _names(c: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """(the block's name under the layer, the expert projections' names: gate, up, down)."""
    if c.architecture in ("MixtralForCausalLM", "MiniMaxM2ForCausalLM"):
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def held_experts(c: ModelConfig) -> range:
    """The routed experts this rank holds: all of them, unless experts are split across ranks."""
    tp = c.tensor_parallel
    return range(*tp.experts) if tp is not None and tp.experts else range(c.moe.num_experts)


def moe_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = expected_shapes(c)
    m = c.moe
    H = c.hidden_size
    block, (gate, up, down) = _names(c)
    for i, sparse in enumerate(m.sparse_layers):
        if not sparse:
            continue
        p = f"model.layers.{i}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}mlp.{name}.weight"]
        q = f"{p}{block}."
        shapes[f"{q}gate.weight"] = (m.num_experts, H)
        for e in held_experts(c):
            shapes[f"{q}experts.{e}.{gate}.weight"] = (m.intermediate_size, H)
            shapes[f"{q}experts.{e}.{up}.weight"] = (m.intermediate_size, H)
            shapes[f"{q}experts.{e}.{down}.weight"] = (H, m.intermediate_size)
        if m.shared_intermediate_size:
            S = m.shared_intermediate_size
            shapes[f"{q}shared_expert.gate_proj.weight"] = (S, H)
            shapes[f"{q}shared_expert.up_proj.weight"] = (S, H)
            shapes[f"{q}shared_expert.down_proj.weight"] = (H, S)
            shapes[f"{q}shared_expert_gate.weight"] = (1, H)
        if m.grouped is not None and m.grouped.correction_bias:
            shapes[f"{q}e_score_correction_bias"] = (m.num_experts,)
    return shapes


class MoeForCausalLM(LlamaForCausalLM):
    expected_shapes = staticmethod(moe_shapes)

    def _mlp(self, weights: dict, p: str, i: int):
        c, m = self.config, self.config.moe
        if not m.sparse_layers[i]:
            return super()._mlp(weights, p, i)
        return self._moe(weights, p)

    def _moe(self, weights: dict, p: str):
        """The mixture-of-experts block under layer prefix p."""
        c, m = self.config, self.config.moe
        block, (gate, up, down) = _names(c)
        q = f"{p}{block}."
        held = held_experts(c)
        gate_up = [self._fuse(weights, [f"{q}experts.{e}.{gate}.weight",
                                        f"{q}experts.{e}.{up}.weight"])
                   for e in held]
        downs = [self._take(weights, f"{q}experts.{e}.{down}.weight") for e in held]
        shared = shared_gate = None
        if m.shared_intermediate_size:
            s = f"{q}shared_expert."
            shared = MLP(self.backend, self._fuse(weights, [f"{s}gate_proj.weight",
                                                            f"{s}up_proj.weight"]),
                         None, self._take(weights, f"{s}down_proj.weight"), None)
            shared_gate = self._take(weights, f"{q}shared_expert_gate.weight")
        bias = None
        if m.grouped is not None and m.grouped.correction_bias:      # MiniMax-M2's router
            bias = self.backend.asarray(np.asarray(weights.pop(f"{q}e_score_correction_bias"),
                                                   dtype=np.float32))
        # kernels moe=fused: grouped GEMMs over stacked experts.
        return MoE(self.backend, self._take(weights, f"{q}gate.weight"), gate_up, downs, m.top_k,
                   m.normalize, shared, shared_gate, fused=self.backend.fused_moe,
                   grouped=m.grouped, correction_bias=bias, first_expert=held.start,
                   num_experts=m.num_experts)
