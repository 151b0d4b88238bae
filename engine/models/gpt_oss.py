"""GPT-OSS (GptOssForCausalLM): the Llama graph with

- attention sinks: a learned logit per query head (`self_attn.sinks`) joins every row's softmax
  with no value, so a head can give little weight to all of its keys (paged_attention's `sinks`;
  on CUDA the masked attention kernel, pyx/attention_dispatch.py);
- sliding-window layers alternating with full ones (`layer_types`), biases on q/k/v and o_proj,
  YaRN RoPE without truncation (config flags, ModelConfig);
- a mixture of experts on every layer (GptOssMoE below): a router with a bias, the softmax over
  each token's top-k router logits, experts with biases whose gate/up projection is stored
  stacked and transposed, (E, H, 2I), gate and up interleaved column by column, and GPT-OSS's
  clamped SwiGLU: gate = min(gate, limit), up = clip(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate) (the backend's clamped_swiglu op). With kernels
  moe=fused the experts take pyx/moe.py's grouped-GEMM ops (no host round trip, so CUDA graphs
  capture the decode step), their biases added per (token, expert) pair by a gather.

MXFP4 checkpoints (quant_method "mxfp4", the released ones) have their experts dequantized at
load to the checkpoint's float dtype (engine/loader/quant_mxfp4.py), then read as a float one.

Split across ranks (engine/parallel/sharding.py) only with expert parallel: each rank holds its
heads (and their sinks) and E / ranks whole experts, whose stacked rows are all it reads.
"""
from __future__ import annotations

import numpy as np

from engine.models.llama import LlamaForCausalLM, expected_shapes
from engine.models.model_config import ModelConfig
from engine.models.moe import held_experts
from pyx.moe import _top_k_by_argmax, align_pairs


def gpt_oss_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = expected_shapes(c)
    m, H = c.moe, c.hidden_size
    E, I = m.num_experts, m.intermediate_size
    held = len(held_experts(c))         # the stacked experts' rows this rank holds
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}mlp.{name}.weight"]
        shapes[f"{p}self_attn.sinks"] = (c.num_attention_heads,)
        shapes[f"{p}mlp.router.weight"], shapes[f"{p}mlp.router.bias"] = (E, H), (E,)
        q = f"{p}mlp.experts."
        shapes[f"{q}gate_up_proj"], shapes[f"{q}gate_up_proj_bias"] = (held, H, 2 * I), (held,
                                                                                       2 * I)
        shapes[f"{q}down_proj"], shapes[f"{q}down_proj_bias"] = (held, I, H), (held, H)
    return shapes


class GptOssForCausalLM(LlamaForCausalLM):
    expected_shapes = staticmethod(gpt_oss_shapes)

    def _attention_extras(self, weights, p, i):
        sinks = np.asarray(weights.pop(f"{p}self_attn.sinks"), dtype=np.float32)
        return {"sinks": self.backend.asarray(np.ascontiguousarray(sinks))}

    def _mlp(self, weights, p, i):
        q = f"{p}mlp.experts."
        gate_up, gate_up_bias = _float(weights, f"{q}gate_up_proj"), _float(weights,
                                                                            f"{q}gate_up_proj_bias")
        down, down_bias = _float(weights, f"{q}down_proj"), _float(weights, f"{q}down_proj_bias")
        place = self.backend.place_weight
        experts = []
        for e in range(gate_up.shape[0]):
            w = gate_up[e].T                 # (2I, H), rows gate0, up0, gate1, up1, ...
            experts.append((
                place(np.ascontiguousarray(np.concatenate([w[0::2], w[1::2]]))),
                place(np.concatenate([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]])
                      .astype(np.float32)),
                place(np.ascontiguousarray(down[e].T)),
                place(np.ascontiguousarray(down_bias[e], dtype=np.float32))))
        router_bias = np.asarray(weights.pop(f"{p}mlp.router.bias"), dtype=np.float32)
        alpha, limit = self.config.moe.clamped_swiglu
        return GptOssMoE(self.backend, self._take(weights, f"{p}mlp.router.weight"),
                         place(router_bias), experts, self.config.moe.top_k, alpha, limit,
                         first_expert=held_experts(self.config).start,
                         num_experts=self.config.moe.num_experts, fused=self.backend.fused_moe)


def _float(weights: dict, name: str) -> np.ndarray:
    w = weights.pop(name)
    if not isinstance(w, np.ndarray):
        raise ValueError(f"{name}: a {type(w).__name__}; GPT-OSS's stacked experts are read "
                         f"in float (bf16, f16 or f32)")
    return w


class GptOssMoE:
    """GPT-OSS's expert block (module docstring): each expert on the tokens routed to it, one
    linear per projection, as pyx/moe.py's reference path; or, fused, the grouped-GEMM ops."""

    def __init__(self, backend, router, router_bias, experts: list, top_k: int, alpha: float,
                 limit: float, first_expert: int = 0, num_experts: int | None = None,
                 fused: bool = False):
        """router (E, H), router_bias (E,) f32; experts[e] = (gate_up (2I, H) with the gate's
        rows first, its bias (2I,), down (H, I), its bias (H,)), placed weights; under expert
        parallel experts [first_expert, ...) of the router's num_experts (pyx/moe.py's MoE).
        fused: the experts' weights stacked for moe_grouped_linear (replacing the per-expert
        ones) and their biases as (E, 2I) and (E, H) float32 tables."""
        self.backend, self.xp = backend, backend.xp
        self.first_expert, self.num_held = first_expert, len(experts)
        self.num_experts = num_experts or len(experts)
        self.router, self.router_bias = router, router_bias
        self.top_k = top_k
        self.alpha, self.limit = alpha, limit
        self.intermediate_size = experts[0][0].shape[0] // 2
        self.fused = fused
        if fused:
            xp = self.xp
            self.gate_up = backend.stack_experts([e[0] for e in experts])
            self.down = backend.stack_experts([e[2] for e in experts])
            self.gate_up_bias = xp.stack([e[1] for e in experts])
            self.down_bias = xp.stack([e[3] for e in experts])
            self.experts = None
        else:
            self.experts = experts

    def route(self, logits):
        """(expert ids (T, top_k) int64, weights (T, top_k) f32): the top_k logits' softmax."""
        xp = self.xp
        logits = logits.astype(xp.float32, copy=False)
        ids = _top_k_by_argmax(logits.copy(), self.top_k, xp)
        top = xp.take_along_axis(logits, ids, axis=1)
        weights = xp.exp(top - top.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        return ids, weights

    def forward(self, x, out, ws):
        """x (T, H) -> out (T, H)."""
        b, xp = self.backend, self.xp
        T, H = x.shape
        k, I = self.top_k, self.intermediate_size
        logits = ws.get("router_logits", T, self.num_experts)
        b.linear(x, self.router, self.router_bias, logits)
        ids, weights = self.route(logits)
        # ids of the held experts from 0; the others fall outside [0, num_held)
        flat = ids.reshape(-1) - self.first_expert
        if self.fused:
            self._experts_fused(x, flat.reshape(ids.shape), weights, out, ws)
            return
        # (token, expert) pairs sorted by expert; a stable sort keeps token order per expert.
        # Pairs of experts another rank holds sort last (as expert E) and add zero.
        E = self.num_held
        if E < self.num_experts:
            flat = xp.where((flat >= 0) & (flat < E), flat, E)
        order = xp.argsort(flat, kind="stable")
        counts = np.asarray(b.to_host(xp.bincount(flat, minlength=E + 1)))
        held = int(counts[:E].sum())
        x_sorted = ws.get("moe_x", T * k, H)
        xp.take(x, order[:held] // k, axis=0, out=x_sorted[:held])
        y_sorted = ws.get("moe_y", T * k, H)
        y_sorted[held:] = 0
        start = 0
        for e in np.flatnonzero(counts[:E]):
            end = start + int(counts[e])
            gate_up_w, gate_up_b, down_w, down_b = self.experts[e]
            gate_up = ws.get("moe_gate_up", end - start, 2 * I)
            act = ws.get("moe_act", end - start, I)
            b.linear(x_sorted[start:end], gate_up_w, gate_up_b, gate_up)
            b.clamped_swiglu(gate_up, act, self.alpha, self.limit)
            b.linear(act, down_w, down_b, y_sorted[start:end])
            start = end
        y = ws.get("moe_pairs", T * k, H)
        y[order] = y_sorted                               # back to (token, slot) order
        y3 = y.reshape(T, k, H)
        xp.multiply(y3, weights.astype(y.dtype)[:, :, None], out=y3)
        y3.sum(axis=1, out=out)

    def _experts_fused(self, x, ids, weights, out, ws):
        """pyx/moe.py MoE._experts_fused's steps with the biases: each pair's gate_up and down
        rows (pair order) plus its expert's bias row, then the weighted sum per token. ids are
        the held experts' from 0; pairs of others (outside [0, E)) are unrouted: moe_align
        leaves them out, moe_combine adds nothing for them, and their bias rows are any."""
        b, xp = self.backend, self.xp
        T, H = x.shape
        k, I, E = self.top_k, self.intermediate_size, self.num_held
        P = T * k
        ids = xp.ascontiguousarray(ids)
        align, block_m = align_pairs(b, ids, E)
        pair_expert = xp.clip(ids.reshape(-1), 0, E - 1)
        gate_up = ws.get("moe_gate_up", P, 2 * I)
        b.moe_grouped_linear(x, self.gate_up, *align, k, block_m, gate_up)
        gate_up += self.gate_up_bias[pair_expert]
        act = ws.get("moe_act", P, I)
        b.clamped_swiglu(gate_up, act, self.alpha, self.limit)
        y = ws.get("moe_pairs", P, H)
        b.moe_grouped_linear(act, self.down, *align, 1, block_m, y)
        y += self.down_bias[pair_expert]
        b.moe_combine(y, weights, ids, E, out)
