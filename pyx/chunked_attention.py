"""Llama 4's chunked attention on the CPU backend (paged_attention's attention_chunk): a query at
position p sees the keys from p // chunk * chunk up to itself. Composed from the plain op: each
sequence's rows are cut where their positions cross a chunk boundary and each piece attends as a
sequence of its own whose keys start at its chunk: its seq_len counts from the chunk's first
position, its block table row starts at the chunk's first block (so the chunk must be a multiple
of the KV block size). The pieces keep the rows' order, so the output rows land where they were.
The CUDA kernel takes the chunk as a mask instead (cuda/attention_prefill.cu)."""
from __future__ import annotations

import numpy as np


def chunked_batch(block_tables, seq_lens, query_start_loc, chunk: int, block_size: int):
    """(block_tables, seq_lens, query_start_loc) of the pieces, int32 host arrays."""
    if chunk % block_size:
        raise ValueError(f"paged_attention: attention_chunk {chunk} is not a multiple of the KV "
                         f"block size {block_size}")
    qsl = np.asarray(query_start_loc)
    lens = np.asarray(seq_lens)
    tables = np.asarray(block_tables)
    starts, piece_lens, rows = [0], [], []
    for b in range(len(lens)):
        s0, s1, S = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        pos = S - (s1 - s0)                         # the position of the row s0
        while pos < S:
            chunk_start = pos // chunk * chunk
            end = min(S, chunk_start + chunk)       # positions [pos, end) in this piece
            starts.append(starts[-1] + end - pos)
            piece_lens.append(end - chunk_start)
            rows.append(tables[b, chunk_start // block_size:])
            pos = end
    width = max([len(r) for r in rows], default=1)
    out_tables = np.zeros((len(rows), max(width, 1)), np.int32)
    for j, r in enumerate(rows):
        out_tables[j, :len(r)] = r
    return (out_tables, np.asarray(piece_lens, np.int32), np.asarray(starts, np.int32))
