"""Gemma 4's per-layer input embeddings (the E2B/E4B models, hidden_size_per_layer_input P):
transformers' Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs and the per-layer
block at the end of each Gemma4TextDecoderLayer.

Once per forward, every token gets L vectors of P values, one per layer:

    context = RMSNorm_P(per_layer_model_projection(embeds) / sqrt(hidden))    (T, L, P)
    identity = embed_tokens_per_layer[token] * sqrt(P)                       (T, L * P)
    inputs = (context + identity) / sqrt(2)

where embeds is the model's scaled input embedding. After its MLP, layer i adds to the stream h

    post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) * inputs_i))

(then layer_scalar scales the stream, engine/models/gemma4.py).

Under tensor parallel (as vLLM splits Gemma 3n's): embed_tokens_per_layer is vocab-parallel (each
rank its share of the rows, the lookups all-reduced: a sum of one row and zeros, exact),
per_layer_model_projection column-parallel with its output gathered (each rank whole output
columns, exact: the rank's P / ranks of each layer's P, engine/parallel/sharding_gemma4.py); each
rank then holds the whole (T, L * P) inputs. The layers' gates and
projections are whole on every rank (they act on the whole, all-reduced stream).
"""
from __future__ import annotations

import math

import numpy as np

from engine.parallel.layers import embed_share


class PerLayerInputs:
    """The step's (T, L * P) per-layer inputs, computed before the layers run and read by each
    layer's PerLayerInputGate (layer i: columns i * P to (i + 1) * P)."""

    def __init__(self, backend, embed_scale: float | None, table, projection, projection_norm,
                 num_layers: int, size: int, hidden_size: int, eps: float,
                 tensor_parallel=None, table_share: int = 0):
        """embed_scale: the model's input embedding multiplier (None: 1); table
        (vocab_size_per_layer_input, L * P): embed_tokens_per_layer; projection (L * P, hidden):
        per_layer_model_projection; projection_norm (P,): per_layer_projection_norm's weight
        (Gemma 4's norms multiply by w). Under tensor_parallel (a TensorParallel) the table is
        the rank's table_share rows and a zero row, the projection its L * P / ranks rows.
        `embed` (token ids, out) -> the scaled model's input embedding is set by the model
        once its embedding is placed."""
        self.backend, self.xp = backend, backend.xp
        self.embed, self.embed_scale = None, embed_scale
        self.table, self.projection, self.projection_norm = table, projection, projection_norm
        self.num_layers, self.size, self.hidden_size, self.eps = num_layers, size, hidden_size, eps
        self.tensor_parallel, self.table_share = tensor_parallel, table_share
        # the multipliers in the activation dtype, as transformers rounds its to the weights'
        self.table_scale = float(np.asarray(math.sqrt(size), dtype=backend.act_dtype))
        # the op table has no plain add: a fused add-and-norm's sum is one (its norm unused)
        self.unit_norm = backend.place_weight(np.ones(size, np.float32))
        self.rows = None

    def compute(self, token_ids, ws) -> None:
        """Sets `rows` (T, L * P) for token_ids (T,), in workspace buffers."""
        b = self.backend
        T, width = token_ids.shape[0], self.num_layers * self.size
        embeds = ws.get("ple_embeds", T, self.hidden_size)
        self.embed(token_ids, embeds)
        if self.embed_scale is not None:
            b.scale(embeds, self.embed_scale)
        context = ws.get("ple_context", T, width)
        tp = self.tensor_parallel
        if tp is None:
            b.linear(embeds, self.projection, None, context)
        else:       # the rank's part of each layer's P columns, gathered in rank order
            n, L = tp.size, self.num_layers
            share = ws.get("ple_context_share", T, width // n)
            b.linear(embeds, self.projection, None, share)
            gathered = tp.comm.all_gather(share).reshape(n, T, L, self.size // n)
            self.xp.copyto(context.reshape(T, L, n, self.size // n),
                           gathered.transpose(1, 2, 0, 3))
        b.scale(context, self.hidden_size ** -0.5)
        rows = ws.get("ple_rows", T, width)
        b.rms_norm(context.reshape(T * self.num_layers, self.size), self.projection_norm,
                   self.eps, rows.reshape(T * self.num_layers, self.size))
        identity = ws.get("ple_identity", T, width)
        if tp is None:
            b.embedding(token_ids, self.table, identity)
        else:
            embed_share(b, tp.comm, token_ids, self.table, tp.rank * self.table_share,
                        self.table_share, identity)
        b.scale(identity, self.table_scale)
        b.fused_add_rms_norm(identity.reshape(T * self.num_layers, self.size),
                             rows.reshape(T * self.num_layers, self.size), self.unit_norm,
                             self.eps)
        b.scale(rows, 2.0 ** -0.5)
        self.rows = rows


class PerLayerInputGate:
    """Layer i's block over the stream after its MLP (module docstring)."""

    def __init__(self, backend, inputs: PerLayerInputs, layer: int, gate, projection,
                 post_norm, eps: float):
        """gate (P, hidden): per_layer_input_gate; projection (hidden, P): per_layer_projection;
        post_norm (hidden,): post_per_layer_input_norm's weight."""
        self.backend, self.xp = backend, backend.xp
        self.inputs, self.layer = inputs, layer
        self.gate, self.projection, self.post_norm, self.eps = gate, projection, post_norm, eps

    def forward(self, stream, out, ws) -> None:
        """stream (T, hidden) -> out (T, hidden), the block's output (not yet added)."""
        b, xp, P = self.backend, self.xp, self.inputs.size
        T = stream.shape[0]
        # gelu_tanh_and_mul takes gate and multiplier side by side in one (T, 2P) array
        gate_and_input = ws.get("ple_gate_and_input", T, 2 * P)
        gate = ws.get("ple_gate", T, P)
        b.linear(stream, self.gate, None, gate)
        xp.copyto(gate_and_input[:, :P], gate)
        xp.copyto(gate_and_input[:, P:], self.inputs.rows[:, self.layer * P:(self.layer + 1) * P])
        b.gelu_tanh_and_mul(gate_and_input, gate)
        projected = ws.get("ple_projected", T, stream.shape[1])
        b.linear(gate, self.projection, None, projected)
        b.rms_norm(projected, self.post_norm, self.eps, out)
