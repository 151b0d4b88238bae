"""KV pool sizing on a GPU (issue 4, item 5).

Order at start-up: weights are on the device; one profiling forward at the largest step
(max_num_batched_tokens tokens, logits for max_num_seqs rows) grows the activation workspace to its
peak and keeps it; CUDA-graph memory is reserved; then the KV pool gets --kv-fraction of what is
free (or --mem MB). Graph capture runs after the pool exists (graphs bake in its pointers), so
the reservation made here is what keeps capture from running out of memory.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from engine.core.hybrid_state import StatePlan
from engine.runner.forward_batch import ForwardBatch

log = logging.getLogger("taper.engine")

DEFAULT_KV_FRACTION = 0.9    # of the memory free after weights, activations and graphs


def profile_forward(model, backend, max_num_batched_tokens: int, max_num_seqs: int,
                    block_size: int) -> None:
    """One forward at the largest step over a one-block dummy KV cache. Every token's slot is -1
    (nothing is written) and all of a sequence's keys read block 0, so it is valid input whose
    only purpose is to allocate the workspace at its peak."""
    T = max_num_batched_tokens
    positions = (np.arange(T) % model.config.max_model_len).astype(np.int32)
    # One sequence per position restart keeps positions consistent with the causal layout.
    starts = np.flatnonzero(positions == 0)
    bounds = np.append(starts, T).astype(np.int32)
    seq_lens = np.diff(bounds).astype(np.int32)
    max_blocks = math.ceil(int(seq_lens.max()) / block_size)
    batch = ForwardBatch(
        token_ids=np.zeros(T, np.int32), positions=positions,
        slot_mapping=np.full(T, -1, np.int32), query_start_loc=bounds, seq_lens=seq_lens,
        block_tables=np.zeros((len(seq_lens), max_blocks), np.int32),
        logits_indices=np.arange(min(T, max_num_seqs), dtype=np.int32))
    dtype = backend.act_dtype
    if hasattr(model, "allocate_caches"):   # a hybrid model: a fresh state row per sequence
        caches = model.allocate_caches(1, block_size, dtype, len(seq_lens))
        rows = np.arange(len(seq_lens))
        batch.state_plan = StatePlan(bounds.astype(np.int64), rows, rows,
                                     np.ones(len(seq_lens), bool), asarray=backend.asarray)
    else:
        caches = model.new_kv_caches(1, block_size, dtype)
    model.forward(batch.map(backend.asarray), caches)
    backend.synchronize()


def kv_budget_bytes(free_bytes: int, reserved_bytes: int, kv_fraction: float | None,
                    kv_cache_memory_mb: int | None) -> tuple[int, str]:
    """(bytes for the KV pool, how it was chosen): --mem MB wins, else the fraction of the memory
    free after the reservation."""
    if kv_cache_memory_mb is not None:
        return kv_cache_memory_mb * 2**20, f"{kv_cache_memory_mb} MB (--mem)"
    fraction = DEFAULT_KV_FRACTION if kv_fraction is None else kv_fraction
    usable = max(0, free_bytes - reserved_bytes)
    return int(usable * fraction), (f"{fraction:g} of {usable / 2**30:.2f} GiB free after "
                                    f"weights, activations and {reserved_bytes / 2**20:.0f} MiB "
                                    "reserved for CUDA graphs")


def log_pool(num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int,
             max_num_seqs: int) -> None:
    tokens = num_blocks * block_size
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB): %d tokens, %d sequences of the full "
             "%d-token context at once (max_num_seqs %d)", num_blocks, block_size,
             num_blocks * bytes_per_block / 2**30, tokens, tokens // max(max_model_len, 1),
             max_model_len, max_num_seqs)
