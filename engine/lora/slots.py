"""The adapter slots of each projection, and the delta they add after the base linear.

A projection (a layer's fused qkv, o, fused gate_up or down) gets `max_loras` slots of fixed size
on the backend: A rows (S, P*R, K), the parts' A stacked (q, k, v read the same input), and
scaling * B^T (S, R, N), the parts side by side in their own output columns; R = --max-lora-rank.
Their dtype (`slot_dtype`): the activations' on CUDA; on the CPU bf16 for a bf16 base (a decode
step reads every slot it uses from memory: half the bytes) and float32 otherwise.
The LoRA delta is added to whatever the base linear wrote, so the base weights may be float,
GGUF blocks, int4 or FP8. Attaching sets the layers' lora_* hooks (pyx/layers.pyx), which do
nothing while no step with adapter rows runs (`LoraStep.rows` None), a CUDA graph's capture
included.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from engine.lora.adapter import LoraPart
from pyx.layers import MLP, Attention


def slot_dtype(backend, base_dtype: str):
    """The slots' element type for a base model whose matrices are `base_dtype` (a dtype name:
    bf16, bfloat16, float32, ...)."""
    if backend.name != "cpu":
        return backend.act_dtype
    return np.dtype(ml_dtypes.bfloat16 if base_dtype in ("bf16", "bfloat16") else np.float32)


class LoraStep:
    """The running step's rows grouped by slot (manager.LoraBatch), read by every projection;
    rows None: no row runs an adapter. slot_of_row: set only while a CUDA graph that covers
    adapter rows is captured (engine/runner/cuda_graph.py): a device array of each row's slot
    (-1: the base model) that the graph reads at every replay; it takes precedence over rows."""
    __slots__ = ("rows", "seg_offsets", "seg_slots", "slot_of_row")

    def __init__(self):
        self.rows = self.seg_offsets = self.seg_slots = self.slot_of_row = None


class LoraProjection:
    def __init__(self, backend, step: LoraStep, num_slots: int, max_rank: int, in_features: int,
                 part_sizes: list[int], dtype):
        xp = backend.xp
        self.backend, self.step = backend, step
        self.num_parts, self.max_rank = len(part_sizes), max_rank
        self.in_features = in_features
        self.parts = np.zeros(len(part_sizes) + 1, np.int32)
        np.cumsum(part_sizes, out=self.parts[1:])
        out_features = int(self.parts[-1])
        self.a = xp.zeros((num_slots, self.num_parts * max_rank, in_features), dtype)
        self.b = xp.zeros((num_slots, max_rank, out_features), dtype)
        self.ranks = np.zeros((num_slots, self.num_parts), np.int32)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def write(self, slot: int, parts: list[LoraPart]) -> None:
        """Slot `slot` holds these parts (none: it adds nothing); everything else in it zero."""
        R, P = self.max_rank, self.num_parts
        a = np.zeros(self.a.shape[1:], self.a.dtype)
        b = np.zeros(self.b.shape[1:], self.b.dtype)
        ranks = np.zeros(P, np.int32)
        for part in parts:
            r, p = part.rank, part.part
            a[p * R:p * R + r] = part.a
            b[:r, self.parts[p]:self.parts[p + 1]] = part.bt
            ranks[p] = r
        xp = self.backend.xp
        xp.copyto(self.a[slot], self.backend.asarray(a))
        xp.copyto(self.b[slot], self.backend.asarray(b))
        self.ranks[slot] = ranks

    def add(self, x, out) -> None:
        """out += the deltas of the step's adapter rows (the layers call it after the base
        linear)."""
        st = self.step
        if st.slot_of_row is not None:
            self.backend.lora_linear_slots(x, self.a, self.b, self.parts, st.slot_of_row, out)
            return
        if st.rows is None:
            return
        self.backend.lora_linear(x, self.a, self.b, self.ranks, self.parts, st.rows,
                                 st.seg_offsets, st.seg_slots, out)


def attach(model, model_config, backend, step: LoraStep, num_slots: int, max_rank: int,
           dtype) -> dict[tuple[int, str], LoraProjection]:
    """Slots for every projection of every layer, hooked into the model's layers; returns them by
    (layer, projection). Only the graph's own attention (pyx.layers.Attention) and dense MLP
    take them: a mixture of experts, latent attention (MLA) or a linear-attention layer does not,
    and an adapter for one is refused (adapter.py). model_config: the model's own (a split
    engine's rank: its heads, its slice of the intermediate size, its stage's layers)."""
    c = model_config
    H, I = c.hidden_size, c.intermediate_size
    out = {}
    for i, layer in enumerate(model.layers):
        attention, mlp = getattr(layer, "attention", None), getattr(layer, "mlp", None)
        # tensor parallel: the MLP over the rank's slice inside its all-reduce (its delta a
        # partial sum, added before the reduce like the base projection's)
        mlp = getattr(mlp, "block", mlp)

        def projection(in_features, part_sizes):
            return LoraProjection(backend, step, num_slots, max_rank, in_features, part_sizes,
                                  dtype)
        if isinstance(attention, Attention):
            q = attention.num_heads * attention.head_dim
            kv = attention.num_kv_heads * attention.head_dim
            attention.lora_qkv = out[i, "qkv"] = projection(H, [q, kv, kv])
            attention.lora_o = out[i, "o"] = projection(q, [H])
        if isinstance(mlp, MLP):
            mlp.lora_gate_up = out[i, "gate_up"] = projection(H, [I, I])
            mlp.lora_down = out[i, "down"] = projection(I, [H])
    return out

