"""The paged KV cache's block bookkeeping, with automatic prefix caching.

Every block is either *in use* (ref_count > 0, in some sequence's block table) or *free* (in the
free queue). The free queue is one LRU list holding never-used blocks and unreferenced blocks that
still carry a prefix-cache hash; popping a hashed block from its head evicts that hash. So cached
blocks cost nothing until the memory is needed, and the least recently freed go first.

Prefix caching keys each FULL block by a hash chain over the token ids:
    hash_i = hash((hash_{i-1}, tuple(tokens of block i)))     (hash_{-1} = None)
so a block hit implies the whole prefix before it matches too. A partially filled block is never
cached. A lookup never covers a sequence's last token: at least one token must be computed to
produce the logits that sample the next one.

Who sets what: the pool owns `seq.block_table` and `seq.block_hashes`. `allocate_slots` with
cached blocks also sets `seq.num_computed_tokens` (to the cached prefix length: the K/V of those
tokens is already in the cache) and, on a sequence's first admission, `seq.num_cached_tokens`.
The scheduler advances `num_computed_tokens` for the tokens a step actually computes.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass
import random

from engine.core.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None   # set while the block is registered in the prefix cache


def hash_block(parent_hash: int | None, token_ids: SequenceLike[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_cached_blocks: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_cached_blocks = max_cached_blocks          # None: as many as the pool holds
        self.blocks = [Block(i) for i in range(num_blocks)]
        # head = next to hand out (least recently freed); OrderedDict gives O(1) pop/remove/append
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[int, Block] = {}          # block hash -> block
        # The free queue's hashed blocks in the same order: what the cap evicts first, found
        # without walking past never-used blocks. Kept only when there is a cap.
        self.free_cached: OrderedDict[int, Block] = OrderedDict()
        self._num_hashed_blocks: dict[int, int] = {}       # seq_id -> blocks cache_full_blocks did
        self.prefix_cache_queries = 0                      # tokens looked up
        self.prefix_cache_hits = 0                         # tokens found

    # ---- sizes

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def max_tokens(self) -> int:
        """Most tokens one sequence can ever hold; the engine checks max_model_len against it."""
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes extended to cover its first `num_blocks` full blocks (tokens are
        append-only, so the chain computed earlier stays valid)."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            if seq.mm is not None:       # image tokens are keyed by their image's content
                tokens = seq.mm.block_key(tokens, i * bs, (i + 1) * bs)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """The longest chain of cached blocks matching seq's tokens, and the tokens they hold.
        A pure lookup: `allocate_slots` takes the blocks, `record_lookup` counts an admission."""
        if not self.enable_prefix_caching or seq.needs_every_prompt_token:
            return [], 0    # prompt logprobs need every prompt token's logits, pooling its rows
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for h in self._block_hashes(seq, max_blocks)[:max_blocks]:
            block = self.cached_blocks.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, seq: Sequence, num_cached_tokens: int):
        """Count one admitted sequence's lookup (a sequence waiting for room is counted once)."""
        if self.enable_prefix_caching and not seq.needs_every_prompt_token:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def cache_full_blocks(self, seq: Sequence):
        """Register the blocks that became full and computed since the last call. A hash already
        mapped to another block keeps that mapping; this sequence's copy stays unhashed."""
        if not self.enable_prefix_caching:
            return
        start = self._num_hashed_blocks.get(seq.seq_id, 0)
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if end <= start:
            return
        hashes = self._block_hashes(seq, end)
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                if not self._room_to_cache():
                    break
                block.block_hash = hashes[i]
                self.cached_blocks[hashes[i]] = block
        self._num_hashed_blocks[seq.seq_id] = end

    def _room_to_cache(self) -> bool:
        """Below the cap on hashed blocks, or made so by evicting the least recently freed
        unreferenced cached block. Blocks in use are never evicted."""
        if self.max_cached_blocks is None or len(self.cached_blocks) < self.max_cached_blocks:
            return True
        if not self.free_cached:
            return False
        _, victim = self.free_cached.popitem(last=False)
        del self.cached_blocks[victim.block_hash]
        victim.block_hash = None
        return True

    def reset_prefix_cache(self):
        """Forget every hash (blocks in use stay allocated; they just stop being shareable)."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.free_cached.clear()

    # ---- allocation

    def _num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                           computed_blocks: SequenceLike[Block]) -> int:
        """Free blocks that allocate_slots would take off the free queue."""
        num_tokens = (seq.num_computed_tokens + len(computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new_blocks = max(0, self.num_blocks_for(num_tokens)
                             - len(seq.block_table) - len(computed_blocks))
        # touching an unreferenced cached block takes it off the free queue too
        return num_new_blocks + sum(1 for b in computed_blocks if b.ref_count == 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     computed_blocks: SequenceLike[Block] = ()) -> bool:
        return self._num_blocks_needed(seq, num_new_tokens, computed_blocks) <= len(self.free_queue)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: SequenceLike[Block] = ()) -> bool:
        """Give seq the cached `computed_blocks` (a fresh admission only) and enough new blocks
        for `num_new_tokens` more tokens past its computed ones. False, changing nothing, when
        the free queue is too short."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        if computed_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0, \
                "cached blocks only go to a sequence with nothing allocated"
            for block in computed_blocks:
                if block.ref_count == 0:
                    del self.free_queue[block.block_id]
                    self.free_cached.pop(block.block_id, None)
                block.ref_count += 1
                seq.block_table.append(block.block_id)
            num_cached = len(computed_blocks) * self.block_size
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:  # a re-admission finds its own blocks: not a hit
                seq.num_cached_tokens = num_cached
            self._num_hashed_blocks[seq.seq_id] = len(computed_blocks)
        num_tokens = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.num_blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._pop_free().block_id)
        return True

    def trim(self, seq: Sequence, num_tokens: int):
        """Free seq's blocks past the first num_blocks_for(num_tokens): a verify step's blocks
        that hold only rejected drafts. They were never hashed (only computed tokens are) nor
        shared, and go to the head of the free queue: they hold nothing worth keeping."""
        keep = self.num_blocks_for(num_tokens)
        if len(seq.block_table) <= keep:
            return
        # the block table's mirrors rewrite the row from here (runner/input_buffers.py)
        seq.trimmed_to = keep if seq.trimmed_to is None else min(seq.trimmed_to, keep)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, \
                f"block {block.block_id} trimmed while shared or cached"
            self.free_queue[block.block_id] = block
            self.free_queue.move_to_end(block.block_id, last=False)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (a beam continuing `parent`, with nothing allocated) parent's computed
        KV: the full blocks shared (one more reference each), a partly filled last block as a
        fresh block, returned as (source, destination) for the caller to copy (the two will
        write different tokens after it). Raises RuntimeError when no block is free."""
        assert not child.block_table
        n = parent.num_computed_tokens
        full = n // self.block_size
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.block_hashes = parent.block_hashes[:full]
        child.num_computed_tokens = n
        self._num_hashed_blocks[child.seq_id] = min(
            self._num_hashed_blocks.get(parent.seq_id, 0), full)
        if n % self.block_size == 0:
            return None
        if not self.free_queue:
            raise RuntimeError("no free KV block to fork a beam into")
        dst = self._pop_free().block_id
        child.block_table.append(dst)
        return parent.block_table[full], dst

    def _pop_free(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:   # evict
            del self.cached_blocks[block.block_hash]
            self.free_cached.pop(block.block_id, None)
            block.block_hash = None
        block.ref_count = 1
        return block

    def free(self, seq: Sequence):
        """Drop seq's references. Blocks reaching zero join the free queue's tail last block
        first, so a sequence's tail is evicted before its (more shareable) prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = block
                if block.block_hash is not None and self.max_cached_blocks is not None:
                    self.free_cached[block_id] = block
        seq.block_table.clear()
        self._num_hashed_blocks.pop(seq.seq_id, None)

    def shuffle_free_blocks(self, rng: random.Random):
        """Randomize the free queue's order (tests: nothing may depend on block ids)."""
        blocks = list(self.free_queue.values())
        rng.shuffle(blocks)
        self.free_queue = OrderedDict((b.block_id, b) for b in blocks)
        if self.max_cached_blocks is not None:
            self.free_cached = OrderedDict((b.block_id, b) for b in blocks
                                           if b.block_hash is not None)
