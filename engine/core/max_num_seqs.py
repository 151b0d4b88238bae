"""The default --max-num-seqs: as many sequences as the KV pool holds at a typical length, up
to 256 (issue 13, item 4).

A step batches every running sequence, so max_num_seqs is the server's concurrency: vLLM and
SGLang run hundreds of sequences at once, because a decode step's cost grows slowly with the
batch (the weights are read once per step). More running sequences than the KV pool can hold
only preempt each other, so the default is what the pool holds at TYPICAL_SEQ_LEN tokens each
(a prompt and its answer; the model's context when that is shorter), capped at 256 (CUDA graphs
are captured for every bucket up to it) and at the step's token budget (every running decode
gets its token each step, engine/core/scheduler.py). An explicit --max-num-seqs wins.
"""
from __future__ import annotations

MAX_NUM_SEQS_CAP = 256
TYPICAL_SEQ_LEN = 1024


def default_max_num_seqs(pool_tokens: int, max_model_len: int,
                         max_num_batched_tokens: int) -> tuple[int, str]:
    """(max_num_seqs, why) for a KV pool of pool_tokens tokens."""
    seq_len = max(1, min(TYPICAL_SEQ_LEN, max_model_len))
    fits = pool_tokens // seq_len
    held = f"the KV pool's {pool_tokens} tokens hold {fits} sequences of {seq_len} tokens"
    if fits >= MAX_NUM_SEQS_CAP and max_num_batched_tokens >= MAX_NUM_SEQS_CAP:
        return MAX_NUM_SEQS_CAP, f"the cap ({held})"
    if max_num_batched_tokens < min(fits, MAX_NUM_SEQS_CAP):
        return max_num_batched_tokens, f"the step's token budget, max_num_batched_tokens ({held})"
    return max(1, fits), held
