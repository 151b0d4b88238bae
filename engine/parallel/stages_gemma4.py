"""Gemma 4's pipeline stages (engine/parallel/pipeline.py; engine/models/gemma4.py has the layout):

- The stage cut: the common even one, except that no cut falls after the first layer whose
  cache a KV-shared layer reads (E2B/E4B): a KV-shared layer reads its source layer's cache,
  written earlier in the same step, so the sources and every layer after them (the shared ones
  are the last) sit on the last stage. A cut past that layer moves down to it (35 layers of
  four sliding to a full one, E2B's, the last 20 shared, reading layers 13 and 14: stages 0-12
  and 13-34 instead of 0-17 and 18-34).
- The stage's per-layer settings (full or sliding, each KV-shared layer's source, renumbered
  into the stage) sliced as the stage's layers are.
- The per-layer inputs are computed on every stage from the batch's token ids, each stage from
  its layers' columns of embed_tokens_per_layer and rows of per_layer_model_projection (which
  is why every stage holds the input embedding: the projection reads it). Sending them with the
  stream instead would add a second array to every hand-over, CUDA graphs' included; computing
  them where their tables are keeps the boundary the residual stream alone, and the tables are
  not held twice (each stage holds its layers' part).
"""
from __future__ import annotations

import dataclasses

ARCHITECTURE = "Gemma4ForCausalLM"


def stage_layers(config, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[first, end) layers of each stage, from the common even cut `bounds` (module
    docstring)."""
    s, L, num_stages = config.family, config.num_hidden_layers, len(bounds)
    shared = [i for i, x in enumerate(s.kv_shared) if x]
    if not shared:
        return bounds
    first_source = min(s.kv_sources[i] for i in shared)
    starts = [min(a, first_source) for a, _ in bounds]
    if len(set(starts)) < num_stages:
        raise ValueError(f"pipeline parallel {num_stages}: {ARCHITECTURE}'s layers "
                         f"{first_source}-{L - 1} must sit on one stage (the KV-shared layers "
                         f"read the caches of layers from {first_source} on), which leaves too "
                         f"few layers before them for {num_stages} stages")
    return list(zip(starts, starts[1:] + [L]))


def local_family(family, first: int, end: int):
    """The stage's layers' settings, the KV-shared layers' sources renumbered into the stage."""
    sources = family.kv_sources[first:end]
    if any(src < first for src in sources):
        raise ValueError(f"pipeline parallel: a KV-shared layer of stage layers {first}-{end - 1} "
                         "reads the cache of a layer on another stage")
    return dataclasses.replace(family, full_layers=family.full_layers[first:end],
                               kv_sources=tuple(src - first for src in sources))


def needs_embedding(config) -> bool:
    """Whether every stage holds the input embedding (the per-layer inputs read it)."""
    return bool(config.family.per_layer_input_size)


def take_per_layer_inputs(weights: dict, stage, family, tensor_parallel_size: int) -> None:
    """In place: the stage's layers' columns of embed_tokens_per_layer (rows: the rank's share
    under tensor parallel) and rows of per_layer_model_projection (whose rows are, under tensor
    parallel, the rank's P / ranks of each layer's P: engine/parallel/sharding_gemma4.py)."""
    P, a, b = family.per_layer_input_size, stage.first_layer, stage.end_layer
    table, projection = ("model.embed_tokens_per_layer.weight",
                         "model.per_layer_model_projection.weight")
    rows = P // tensor_parallel_size
    weights[table] = weights[table][:, a * P:b * P]
    weights[projection] = weights[projection][a * rows:b * rows]
