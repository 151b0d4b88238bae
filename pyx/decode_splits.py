"""How many key partitions flash-decoding gives each (sequence, KV head): a pure function of the
batch, the context, the cache's block size and the device, chosen on the host before a launch
(and so before a CUDA Graph capture, which freezes it for the bucket).

Decode attention reads the whole KV cache once per step and does little arithmetic on it, so it is
bound by memory bandwidth, and an SM only pulls its share of that bandwidth while enough loads are
in flight on it. The decode kernel (cuda/attention_decode.cu) runs one 128-thread block per
(sequence, KV head, partition), up to 4 of them resident per SM. The 2026-11-24 H100 run measured
its bandwidth growing with resident blocks per SM: 1 -> 21 %, 2 -> 40 %, 3 -> 70-75 %,
4 -> 85 % of the copy rate. So the rule fills the device's resident-block slots
(num_sms * blocks_per_sm) with batch * kv_heads * splits blocks:

- one split when the batch alone fills them (more partitions would only add merge traffic);
- else the split count whose last wave is fullest (blocks run in waves of `slots`; a partly
  filled last wave leaves SMs idle), taking the smallest count within 90 % of the best, since
  every partition costs a (D + 2)-float partial written and read back by the merge;
- never more partitions than the context has KV blocks (the kernel's partitions are whole
  blocks, so more would be empty), nor partitions shorter than `min_keys` (a partition's fixed
  cost, loading q and writing the partial, must stay small next to its keys), nor more than the
  merge kernel takes (64).

The kernel sizes the partitions of each sequence from its own length at run time, so a count
chosen for the longest context a step may see (the engine passes max_model_len) stays right for
shorter sequences: their partitions just hold fewer keys.
"""
from __future__ import annotations

import functools

MAX_SPLITS = 64          # the merge kernel keeps one weight per partition in shared memory
BLOCKS_PER_SM = 4        # the decode kernel's __launch_bounds__ minimum (kMinBlocks)
MIN_KEYS = 64            # two of the kernel's 32-key tiles: its double buffer still overlaps
GOOD_ENOUGH = 0.9        # of the best wave efficiency: the smallest count reaching it wins


def wave_efficiency(num_blocks: int, slots: int) -> float:
    """Fraction of resident-block slots busy over the waves that num_blocks blocks take."""
    waves = -(-num_blocks // slots)
    return num_blocks / (waves * slots)


# Cached: the backend asks once per attention layer and step (tens of microseconds of Python
# each, ~2 ms per step over 32 layers without CUDA graphs); the arguments repeat step after step.
@functools.lru_cache(maxsize=4096)
def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, block_size: int,
                      num_sms: int, blocks_per_sm: int = BLOCKS_PER_SM,
                      max_splits: int = MAX_SPLITS, min_keys: int = MIN_KEYS) -> int:
    """Partitions per (sequence, KV head) for a decode step of `batch` sequences of at most
    `max_context` keys in a cache of `block_size`-key blocks, on `num_sms` SMs. 1 means the
    one-pass kernel (no merge). Degenerate inputs (any size <= 0) give 1."""
    work = batch * num_kv_heads
    if min(work, max_context, block_size, num_sms, blocks_per_sm, max_splits) <= 0:
        return 1
    slots = num_sms * blocks_per_sm
    if work >= slots:
        return 1
    kv_blocks = -(-max_context // block_size)
    limit = max(1, min(max_splits, kv_blocks, max_context // min_keys))
    # The kernel rounds each partition up to whole blocks, so only some counts are reachable
    # (each with no partition left empty at max_context): 29 splits of 4096 keys in 128-key
    # blocks are really 16 partitions of 256 keys; weigh the counts the kernel will run.
    counts = sorted({-(-max_context // partition_keys(max_context, s, block_size))
                     for s in range(1, limit + 1)})
    eff = [wave_efficiency(work * s, slots) for s in counts]
    best = max(eff)
    return next(s for s, e in zip(counts, eff) if e >= GOOD_ENOUGH * best)


def partition_keys(context: int, splits: int, block_size: int) -> int:
    """The kernel's partition length: ceil(context / splits) rounded up to whole blocks."""
    return -(-(-(-context // splits)) // block_size) * block_size
