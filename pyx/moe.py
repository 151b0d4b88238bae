"""The mixture-of-experts block, written once for Mixtral, Qwen2-MoE and Qwen3-MoE.

    router logits = x @ gate.T;  p = softmax(logits) in float32;  the top_k experts per token,
    their p renormalised to sum to 1 when `normalize` (Mixtral always, Qwen3-MoE by
    norm_topk_prob, Qwen2-MoE usually not);  out = sum_k p_k * expert_k(x)
    (+ sigmoid(x @ shared_gate.T) * shared_expert(x), Qwen2-MoE's shared expert; DeepSeek's
    shared experts are added without a gate)

DeepSeekMoE routes by `route_grouped` instead (engine/models/deepseek_config.py has the rules):
softmax or sigmoid scores, a correction bias in the choice, the best groups of experts first,
routed_scaling_factor on the weights.

Each expert is a SwiGLU MLP (gate and up fused). Experts run only on the tokens routed to them:
the (token, expert) pairs are sorted by expert, the tokens gathered in that order, each expert's
contiguous run of rows goes through its two projections, and the results are put back in pair
order and summed per token with their weights. The projections are the backend's `linear`, so
every weight format (float, ggml blocks, int4, FP8) works for experts as for dense layers.

On a backend with moe_experts_op (the CPU) those steps are one backend call, moe_experts: every
expert of the layer, the activation and the weighted sum in one C kernel (pyx/moe_kernels.c), the
same numbers as the loop over experts, which the CUDA backend runs on its simple path.

The fused path (`fused`, the backend's fused_moe: kernels moe=fused) takes the same steps with no
per-expert loop and no host round trip: moe_align sorts the pairs by expert on the device, padded
to the grouped GEMM's M tile; moe_grouped_linear runs gate_up for every expert in one launch, then
silu_and_mul, then down in one launch; moe_combine sums each token's top_k rows with their weights.
The experts' weights are stacked once at load (backend.stack_experts). The CPU backend implements
those ops as the reference (each expert through its own `linear`).

Expert parallel: a rank holds experts [first_expert, first_expert + len(experts)) of the router's
num_experts. It routes every token as one process would, then runs only the pairs routed to its
experts (the others are unrouted: moe_align leaves them out, moe_combine adds nothing for them);
its output is its share of the weighted sum, completed by the all-reduce after the block.

Like pyx/layers.pyx, no device code: backend ops and the array API NumPy and CuPy share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class StackedExperts:
    """E experts' weights of one projection, each (N, K), as one moe_grouped_linear or
    moe_experts operand. `experts`: the placed weights one by one (the CPU reference runs each
    through linear); `data`: the CUDA backend's stack, (E, N, K) in the activation dtype or, for
    Q8_0 experts (`qtype` 8), (E, N, K / 32 * 34) bytes of ggml blocks; `qtype` 0 means the
    activation dtype. On the CPU `data` is moe_experts' table of the weights' parts, or None
    (CpuBackend.stack_experts)."""
    shape: tuple[int, int, int]
    experts: list | None = None
    data: object = None
    qtype: int = 0


def moe_align_capacity(P: int, E: int, block_m: int) -> int:
    """Rows of moe_align's sorted_ids for P pairs: each expert holding a pair pads its run by at
    most block_m - 1 rows, rounded up to whole tiles (cuda/moe.cu computes the same)."""
    rows = P + min(E, P) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_block_m(P: int, E: int) -> int:
    """The grouped GEMM's M tile: 64 once experts average 64 pair rows (prefill: each weight tile
    loaded feeds 4x the rows), else 16 (decode: less padding, and the weight bytes read are the
    same either way)."""
    return 64 if P >= 64 * E else 16


def align_pairs(backend, ids, num_experts: int):
    """moe_align of the (token, expert) pairs in ids (T, k), contiguous: ((sorted_ids,
    block_expert, num_padded), block_m), what moe_grouped_linear takes. Ids outside
    [0, num_experts) are unrouted (left out)."""
    xp = backend.xp
    P, E = ids.size, num_experts
    block_m = moe_block_m(P, E)
    capacity = moe_align_capacity(P, E, block_m)
    sorted_ids = xp.empty(capacity, xp.int32)
    block_expert = xp.empty(capacity // block_m, xp.int32)
    offsets = xp.empty(E + 1, xp.int32)
    num_padded = xp.empty(1, xp.int32)
    backend.moe_align(ids, E, block_m, sorted_ids, block_expert, offsets, num_padded)
    return (sorted_ids, block_expert, num_padded), block_m


def route(logits, top_k: int, normalize: bool, xp=np, graph_safe: bool = False):
    """logits (T, E) -> (expert ids (T, top_k) int64, weights (T, top_k) float32): the top_k
    experts of each token by softmax probability (their order within a row is unspecified).
    graph_safe: select by top_k argmax passes (lowest index on ties) instead of a partition:
    argmax is a plain reduction kernel a CUDA graph can capture, while CuPy's argpartition sorts
    through Thrust, which may synchronize the stream (not yet checked on a GPU)."""
    logits = logits.astype(xp.float32, copy=False)
    probs = xp.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    if graph_safe:
        ids = xp.empty((probs.shape[0], top_k), xp.int64)
        left = probs.copy()
        rows = xp.arange(probs.shape[0])
        for j in range(top_k):
            ids[:, j] = left.argmax(axis=1)
            left[rows, ids[:, j]] = -1.0                # below every probability
    else:
        ids = xp.argpartition(-probs, top_k - 1, axis=1)[:, :top_k]
    weights = xp.take_along_axis(probs, ids, axis=1)
    if normalize:
        weights /= weights.sum(axis=1, keepdims=True)
    return ids.astype(xp.int64), weights


def _top_k_by_argmax(scores, k: int, xp):
    """(T, k) int64 ids of each row's k largest scores by k argmax passes (lowest index on
    ties): plain reductions a CUDA graph can capture. `scores` may be overwritten. NumPy: one
    stable sort of the negated scores, the same ids in the same order (largest first, ties by
    lowest index) in a fifth of the k passes' time (a decode step's routing, per MoE layer)."""
    if xp is np:
        return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64, copy=False)
    ids = xp.empty((scores.shape[0], k), xp.int64)
    rows = xp.arange(scores.shape[0])
    for j in range(k):
        ids[:, j] = scores.argmax(axis=1)
        scores[rows, ids[:, j]] = -xp.inf
    return ids


def route_grouped(logits, top_k: int, normalize: bool, routing, bias=None, xp=np):
    """DeepSeekMoE's router: logits (T, E) -> (expert ids (T, top_k) int64, weights (T, top_k)
    float32). routing: an engine.models.deepseek_config.GroupedRouting; bias (E,) float32, the
    sigmoid routers' e_score_correction_bias (it steers the choice, not the weights)."""
    logits = logits.astype(xp.float32, copy=False)
    T, E = logits.shape
    if routing.scoring == "softmax":
        scores = xp.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    else:
        scores = (1.0 / (1.0 + xp.exp(-logits))).astype(xp.float32)
    choice = scores + bias.astype(xp.float32) if bias is not None else scores.copy()
    if routing.method != "greedy":
        G = routing.num_groups
        grouped = choice.reshape(T, G, E // G)
        if routing.method == "group_limited_greedy":     # a group's best score
            group_scores = grouped.max(axis=2)
        else:                                            # the sum of its best two
            best = _top_k_by_argmax(grouped.reshape(T * G, E // G).copy(), 2, xp)
            group_scores = xp.take_along_axis(grouped.reshape(T * G, E // G), best, axis=1)
            group_scores = (group_scores[:, 0] + group_scores[:, 1]).reshape(T, G)
        kept = _top_k_by_argmax(group_scores.copy(), routing.topk_groups, xp)
        mask = xp.zeros((T, G), bool)
        mask[xp.arange(T)[:, None], kept] = True
        mask = xp.repeat(mask, E // G, axis=1)
        # V2 zeroes the other groups' scores, V3 rules them out
        choice = xp.where(mask, choice, xp.float32(0.0 if routing.method ==
                                                   "group_limited_greedy" else -xp.inf))
    ids = _top_k_by_argmax(choice.astype(xp.float32, copy=True), top_k, xp)
    weights = xp.take_along_axis(scores, ids, axis=1)
    if normalize:
        weights /= weights.sum(axis=1, keepdims=True) + xp.float32(1e-20)
    weights *= xp.float32(routing.routed_scaling_factor)
    return ids, weights.astype(xp.float32, copy=False)


class MoE:
    def __init__(self, backend, router, experts_gate_up: list, experts_down: list, top_k: int,
                 normalize: bool, shared=None, shared_gate=None, fused: bool = False,
                 grouped=None, correction_bias=None, activation: str = "silu",
                 expert_scale=None, first_expert: int = 0, num_experts: int | None = None):
        """router (E, H); experts_gate_up[e] (2I, H) and experts_down[e] (H, I), placed weights;
        shared: an MLP-like object with forward(x, out, ws) (the shared expert) and shared_gate
        (1, H), or None (added ungated). fused: the grouped-GEMM path (the experts are stacked
        here). grouped: DeepSeekMoE's GroupedRouting, routed by route_grouped with
        correction_bias (E,) f32 or None; None: route's softmax top-k. activation: the experts'
        gate, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma 4). expert_scale (E,) f32 or None:
        each chosen expert's weight multiplied by its own scale after routing (Gemma 4's
        per_expert_scale). first_expert, num_experts: the experts given are [first_expert, ...)
        of the router's num_experts (expert parallel; default: all of them)."""
        self.backend = backend
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"MoE: unknown activation {activation!r}, expected silu or "
                             f"gelu_tanh")
        self.activation = activation
        self.act_and_mul = (backend.silu_and_mul if activation == "silu" else
                            backend.gelu_tanh_and_mul)
        self.expert_scale = expert_scale
        self.grouped, self.correction_bias = grouped, correction_bias
        self.xp = backend.xp
        self.router = router
        self.num_held = len(experts_gate_up)
        self.num_experts = num_experts or self.num_held
        self.first_expert = first_expert
        if not 0 <= first_expert <= self.num_experts - self.num_held:
            raise ValueError(f"MoE: experts [{first_expert}, {first_expert + self.num_held}) "
                             f"are not among the router's {self.num_experts}")
        self.top_k, self.normalize = top_k, normalize
        self.intermediate_size = experts_gate_up[0].shape[0] // 2
        self.shared, self.shared_gate = shared, shared_gate
        self.fused = fused
        self.one_call = not fused and backend.moe_experts_op   # CPU: moe_experts
        if fused or self.one_call:   # the stacks replace the per-expert weights (no copy kept)
            self.gate_up = backend.stack_experts(experts_gate_up)
            self.down = backend.stack_experts(experts_down)
        else:
            self.gate_up, self.down = experts_gate_up, experts_down

    def forward(self, x, out, ws):
        """x (T, H) -> out (T, H)."""
        b, xp = self.backend, self.xp
        T, H = x.shape
        ids, weights = self.select(x, ws)
        self.run_experts(x, ids, weights, out, ws)
        if self.shared is not None:
            shared_out = ws.get("moe_shared", T, H)
            self.shared.forward(x, shared_out, ws)
            if self.shared_gate is None:
                out += shared_out
                return
            gate = ws.get("moe_shared_gate", T, 1)
            b.linear(x, self.shared_gate, None, gate)
            g = gate.astype(xp.float32)
            shared_out *= (1.0 / (1.0 + xp.exp(-g))).astype(shared_out.dtype)
            out += shared_out

    def select(self, x, ws):
        """The router on x (T, H) -> (expert ids (T, top_k) int64, their weights (T, top_k))."""
        xp = self.xp
        logits = ws.get("router_logits", x.shape[0], self.num_experts)
        self.backend.linear(x, self.router, None, logits)
        if self.grouped is not None:
            ids, weights = route_grouped(logits, self.top_k, self.normalize, self.grouped,
                                         self.correction_bias, xp)
        else:
            ids, weights = route(logits, self.top_k, self.normalize, xp, graph_safe=self.fused)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        return ids, weights

    def run_experts(self, x, ids, weights, out, ws):
        """out (T, H) = the chosen experts' outputs on x (T, H), weighted and summed (of the
        held experts only: ids of the others fall outside [0, num_held) once shifted)."""
        if self.first_expert:
            ids = ids - self.first_expert
        if self.fused:
            self._experts_fused(x, ids, weights, out, ws)
        elif self.one_call:
            xp = self.xp
            self.backend.moe_experts(xp.ascontiguousarray(x), self.gate_up, self.down,
                                     xp.ascontiguousarray(ids, dtype=xp.int64),
                                     xp.ascontiguousarray(weights, dtype=xp.float32),
                                     self.activation, out)
        else:
            self._experts_one_by_one(x, ids, weights, out, ws)

    def _experts_fused(self, x, ids, weights, out, ws):
        """The grouped-GEMM path: no host round trip, a fixed number of launches."""
        b, xp = self.backend, self.xp
        T, H = x.shape
        k, I, E = self.top_k, self.intermediate_size, self.num_held
        P = T * k
        ids = xp.ascontiguousarray(ids)
        align, block_m = align_pairs(b, ids, E)
        gate_up = ws.get("moe_gate_up", P, 2 * I)
        act = ws.get("moe_act", P, I)
        y = ws.get("moe_pairs", P, H)
        b.moe_grouped_linear(x, self.gate_up, *align, k, block_m, gate_up)
        self.act_and_mul(gate_up, act)
        b.moe_grouped_linear(act, self.down, *align, 1, block_m, y)
        b.moe_combine(y, weights, ids, E, out)

    def _experts_one_by_one(self, x, ids, weights, out, ws):
        b, xp = self.backend, self.xp
        T, H = x.shape
        k, I = self.top_k, self.intermediate_size

        # (token, expert) pairs, sorted by expert; a stable sort keeps token order per expert.
        # Pairs of experts another rank holds sort last (as expert num_held) and add zero.
        E = self.num_held
        flat = ids.reshape(-1)
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
            gate_up = ws.get("moe_gate_up", end - start, 2 * I)
            act = ws.get("moe_act", end - start, I)
            b.linear(x_sorted[start:end], self.gate_up[e], None, gate_up)
            self.act_and_mul(gate_up, act)
            b.linear(act, self.down[e], None, y_sorted[start:end])
            start = end

        y = ws.get("moe_pairs", T * k, H)
        y[order] = y_sorted                               # back to (token, slot) order
        y3 = y.reshape(T, k, H)
        xp.multiply(y3, weights.astype(y.dtype)[:, :, None], out=y3)
        y3.sum(axis=1, out=out)
