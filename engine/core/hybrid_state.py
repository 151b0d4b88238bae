"""The recurrent state of hybrid models (Qwen3-Next, Qwen3.5: gated DeltaNet layers beside full
attention): a state slot per running sequence, and state snapshots for the prefix cache.

A linear-attention layer keeps no K/V: what it knows of a sequence is one fixed-size state (the
convolution's last inputs and the delta rule's matrices, pyx/gated_delta_net.py). So:

- **Slots.** Each running sequence owns one of `num_slots` state rows (a fixed pool sized at
  start, which bounds max_num_seqs); it takes a slot when admitted and gives it back when it
  finishes or is preempted (recompute: it starts again from its first token, or from a
  snapshot). Chunked prefill carries the state in the slot from one chunk to the next.
- **Snapshots.** A cached prefix of attention blocks is only worth its K/V if the linear layers'
  state after that prefix is known too. So each step takes, per sequence, a snapshot of the
  state at the last block boundary its chunk reaches, and at the last one before its final
  prompt token (what a re-sent prompt or an n > 1 sibling looks up), into one of
  `num_snapshots` rows, keyed by the hash of the block that ends there (the block hash chain
  implies the whole prefix). A decode step that completes a block snapshots there, so a
  conversation's next turn finds its history up to the last full block. A prefix-cache hit is
  cut back to the longest prefix whose last block has a snapshot, and the sequence's slot starts
  from that snapshot. Snapshots are kept in LRU order; taking one when none is free evicts the
  least recently used.
- **Verify rows.** Speculative decoding scores a decoding sequence's last known token and its k
  drafts in one step, and the recurrence runs through all of them. So the step also keeps the
  state after the known rows plus j drafts, j = 0..k-1, in k verify rows (vLLM keeps the
  per-position states of Mamba and GDN layers the same way); once the drafts are verified with a
  accepted (a < k), the forward thread copies the state of row a into the slot
  (ModelRunner.keep_verified_states), exactly the state of decoding only the accepted tokens.
  The verify rows are reused by every step: a step speculates for at most
  min(slots, disable_by_batch_size) sequences. A snapshot whose boundary lies past the accepted
  rows is dropped when the rejected rows are (trim): its state saw rejected drafts.

HybridBlockPool is the BlockPool with this bookkeeping: the scheduler uses it unchanged
(allocate_slots fails, changing nothing, when no slot is free; free() at a finish or preemption
returns the slot). The model runner asks it for each step's StatePlan; snapshots are reserved
then and registered for lookups only by cache_full_blocks (the scheduler's update, once the step
has run), as blocks are.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine.core.block_pool import BlockPool
from engine.core.max_num_seqs import MAX_NUM_SEQS_CAP

log = logging.getLogger("taper.engine")


@dataclass(slots=True)
class StatePlan:
    """What the linear-attention layers do with the state rows in one step (B sequences, in the
    step's order; host arrays; `asarray` puts an index array where the model computes)."""
    starts: np.ndarray                 # (B + 1,) int64: each sequence's rows in the batch
    slots: np.ndarray                  # (B,) int64: the row its state is written back to
    src_rows: np.ndarray               # (B,) int64: the row its state starts from
    fresh: np.ndarray                  # (B,) bool: starts from zero (its first token)
    saves: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, offset, row)
    asarray: object = None             # the backend's asarray
    lengths: np.ndarray | None = None  # (B,): rows per sequence (from starts)
    # (seq, seq_id, k, first row): a sequence verifying k drafts keeps its state after its known
    # rows and j drafts in row first + j (j < k), saved like the snapshots
    verify: list[tuple[int, int, int, int]] = field(default_factory=list)

    def __post_init__(self):
        if self.asarray is None:
            self.asarray = np.asarray
        self.lengths = np.diff(self.starts)

    def __reduce__(self):
        """Sent to the other tensor-parallel ranks without rank 0's asarray (a backend's method):
        each rank's runner sets its own (ModelRunner.run)."""
        return StatePlan, (self.starts, self.slots, self.src_rows, self.fresh, self.saves, None,
                           None, self.verify)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def any_fresh(self) -> bool:
        return bool(self.fresh.any())

    @property
    def seq_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_seqs), self.lengths)

    def of_sequences(self, first: int, end: int) -> "StatePlan":
        """The plan of sequences [first, end) alone, renumbered from 0 (a pipeline stage's
        micro-batch of them: engine/parallel/pipeline.py); the same state rows."""
        return StatePlan(
            self.starts[first:end + 1] - self.starts[first], self.slots[first:end],
            self.src_rows[first:end], self.fresh[first:end],
            [(i - first, offset, row) for i, offset, row in self.saves if first <= i < end],
            self.asarray,
            verify=[(i - first, *rest) for i, *rest in self.verify if first <= i < end])

    def saves_by_offset(self) -> dict[int, list[tuple[int, int]]]:
        """offset -> [(sequence, snapshot row)]: the state after `offset` of its rows."""
        out: dict[int, list[tuple[int, int]]] = {}
        for i, offset, row in self.saves:
            out.setdefault(offset, []).append((i, row))
        return out


class HybridBlockPool(BlockPool):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_cached_blocks: int | None = None, num_slots: int = 1,
                 num_snapshots: int = 0, num_verify_rows: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching,
                         max_cached_blocks=max_cached_blocks)
        if num_slots < 1:
            raise ValueError("a hybrid model needs at least one state slot")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots if enable_prefix_caching else 0
        self.num_verify_rows = num_verify_rows       # speculative decoding's (see above)
        self._free_slots = list(range(num_slots - 1, -1, -1))      # pop() gives the lowest
        self._slot_of: dict[int, int] = {}                        # seq_id -> slot
        self._free_snapshot_rows = list(range(num_slots + self.num_snapshots - 1,
                                              num_slots - 1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()     # block hash -> row, LRU first
        self._pending: dict[int, list[tuple[int, int]]] = {}      # seq_id -> [(boundary, row)]
        self._restores: dict[int, int] = {}                       # seq_id -> snapshot row
        self.num_snapshots_taken = 0        # registered for lookups
        self.num_snapshot_restores = 0      # admissions that started from a snapshot
        self.num_prefix_tokens_cut = 0      # cached tokens given up for want of a snapshot
        self._last_cut = 0

    @property
    def num_state_rows(self) -> int:
        """Rows of each linear layer's state arrays: the slots, the snapshots, then the verify
        rows."""
        return self.num_slots + self.num_snapshots + self.num_verify_rows

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def slot_of(self, seq) -> int | None:
        return self._slot_of.get(seq.seq_id)

    # ---- prefix cache: hits only where a snapshot is

    def get_computed_blocks(self, seq):
        blocks, num_cached = super().get_computed_blocks(seq)
        k = len(blocks)
        while k and seq.block_hashes[k - 1] not in self.snapshots:
            k -= 1
        self._last_cut = num_cached - k * self.block_size
        return blocks[:k], k * self.block_size

    def record_lookup(self, seq, num_cached_tokens: int):
        super().record_lookup(seq, num_cached_tokens)
        self.num_prefix_tokens_cut += self._last_cut      # that admission's lookup
        self._last_cut = 0

    def allocate_slots(self, seq, num_new_tokens, computed_blocks=()) -> bool:
        """BlockPool's, and a state slot for a sequence that has none (False, changing
        nothing, when none is free); with cached blocks its state starts from their snapshot."""
        needs_slot = seq.seq_id not in self._slot_of
        if needs_slot and not self._free_slots:
            return False
        if not super().allocate_slots(seq, num_new_tokens, computed_blocks):
            return False
        if needs_slot:
            self._slot_of[seq.seq_id] = self._free_slots.pop()
            if computed_blocks:
                key = seq.block_hashes[len(computed_blocks) - 1]
                self.snapshots.move_to_end(key)
                self._restores[seq.seq_id] = self.snapshots[key]
                self.num_snapshot_restores += 1
        return True

    def fork(self, parent, child):
        raise ValueError("a hybrid model's recurrent state cannot be forked (beam search)")

    def free(self, seq):
        super().free(seq)
        slot = self._slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._restores.pop(seq.seq_id, None)
        # a snapshot the sequence's step may still write is never registered
        self._free_snapshot_rows += [row for _, row in self._pending.pop(seq.seq_id, ())]

    def cache_full_blocks(self, seq):
        """BlockPool's, and the snapshots of the steps that have run registered by the hash of
        the block ending at their boundary."""
        super().cache_full_blocks(seq)
        pending = self._pending.get(seq.seq_id)
        if not pending:
            return
        keep = []
        for boundary, row in pending:
            if boundary > seq.num_computed_tokens:      # its step is still to run
                keep.append((boundary, row))
                continue
            num_blocks = boundary // self.block_size
            key = self._block_hashes(seq, num_blocks)[num_blocks - 1]
            if key in self.snapshots:                   # the same prefix's state, kept once
                self._free_snapshot_rows.append(row)
            else:
                self.snapshots[key] = row
                self.num_snapshots_taken += 1
        if keep:
            self._pending[seq.seq_id] = keep
        else:
            del self._pending[seq.seq_id]

    def trim(self, seq, num_tokens: int):
        """BlockPool's, after a verify step's rejection: the snapshots its step reserved past
        the accepted rows are given up (they hold a state that saw rejected drafts)."""
        super().trim(seq, num_tokens)
        pending = self._pending.get(seq.seq_id)
        if not pending:
            return
        keep = [(b, row) for b, row in pending if b <= seq.num_computed_tokens]
        self._free_snapshot_rows += [row for b, row in pending if b > seq.num_computed_tokens]
        if keep:
            self._pending[seq.seq_id] = keep
        else:
            del self._pending[seq.seq_id]

    def reset_prefix_cache(self):
        super().reset_prefix_cache()
        self._free_snapshot_rows += list(self.snapshots.values())
        self.snapshots.clear()

    # ---- a step's plan

    def plan(self, sched) -> StatePlan:
        """The state rows of a scheduled step (called once per step, after schedule())."""
        B = len(sched.seqs)
        slots = np.array([self._slot_of[s.seq_id] for s in sched.seqs], np.int64)
        src_rows = slots.copy()
        for i, seq in enumerate(sched.seqs):
            row = self._restores.pop(seq.seq_id, None)
            if row is not None:
                src_rows[i] = row
        starts = np.zeros(B + 1, np.int64)
        np.cumsum(sched.num_new_tokens, out=starts[1:])
        saves = []
        if self.num_snapshots:
            for i, (seq, start, n) in enumerate(zip(sched.seqs, sched.num_computed,
                                                    sched.num_new_tokens)):
                for boundary in self._snapshot_boundaries(seq, start, start + n):
                    row = self._reserve_snapshot_row()
                    if row is None:
                        break
                    self._pending.setdefault(seq.seq_id, []).append((boundary, row))
                    saves.append((i, boundary - start, row))
        verify = []
        row = self.num_slots + self.num_snapshots
        for i, (seq, n, k) in enumerate(zip(sched.seqs, sched.num_new_tokens,
                                            sched.num_drafts or [0] * B)):
            if not k:
                continue
            if row + k > self.num_state_rows:
                raise RuntimeError(f"speculative decoding: {k} drafts of a sequence need verify "
                                   f"state rows beyond the {self.num_verify_rows} sized at start")
            saves += [(i, n - k + j, row + j) for j in range(k)]
            verify.append((i, seq.seq_id, k, row))
            row += k
        return StatePlan(starts, slots, src_rows, np.array(sched.num_computed) == 0, saves,
                         verify=verify)

    def _snapshot_boundaries(self, seq, start: int, end: int) -> list[int]:
        """Block boundaries in (start, end] to snapshot: the last one, and the last one before
        the final prompt token; not those whose prefix has a snapshot already."""
        bs = self.block_size
        wanted = {end // bs * bs, (seq.num_prompt_tokens - 1) // bs * bs}
        out = []
        for b in sorted(wanted):
            if not start < b <= end:
                continue
            if b <= seq.num_tokens:          # tokens known: skip a prefix already kept
                key = self._block_hashes(seq, b // bs)[b // bs - 1]
                if key in self.snapshots:
                    self.snapshots.move_to_end(key)
                    continue
            out.append(b)
        return out

    def _reserve_snapshot_row(self) -> int | None:
        if self._free_snapshot_rows:
            return self._free_snapshot_rows.pop()
        if self.snapshots:                   # evict the least recently used
            return self.snapshots.popitem(last=False)[1]
        return None


@dataclass(slots=True)
class StatePoolSize:
    """How many state rows a hybrid model gets, and what they cost."""
    num_slots: int
    num_snapshots: int
    row_bytes: int
    num_verify_rows: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + self.num_snapshots + self.num_verify_rows) * self.row_bytes

    @classmethod
    def for_model(cls, config, model_config, budget_bytes: int | None,
                  budget_what: str = "") -> "StatePoolSize | None":
        """None for a model without linear attention. Slots: --max-num-seqs, else as many as
        half the budget holds (slots and as many snapshots), at most the concurrency cap and
        the step's token budget; snapshots: EngineConfig.state_snapshots, else one per slot
        (none without prefix caching); verify rows (speculative decoding): k for each sequence a
        step may speculate for. budget_bytes None: an explicit KV block count, the states come
        on top of it."""
        la = model_config.linear_attention
        if la is None:
            return None
        row_bytes = la.state_floats() * 4
        explicit_snapshots = getattr(config, "state_snapshots", None)
        spec = getattr(config, "speculative_config", None)
        k = spec.num_speculative_tokens if spec is not None else 0
        gate = spec.disable_by_batch_size if spec is not None else None
        if config.max_num_seqs is not None:
            slots = config.max_num_seqs
        else:
            slots = min(MAX_NUM_SEQS_CAP, config.max_num_batched_tokens)
            # (row_bytes 0: a pipeline stage without linear layers; the other stages' rows
            # bound the slots, every rank taking the fewest)
            if budget_bytes is not None and row_bytes:
                per_slot = row_bytes * (1 if explicit_snapshots is not None
                                        or not config.enable_prefix_caching else 2)
                fixed = row_bytes * (explicit_snapshots or 0)
                if gate is None:          # every slot may speculate
                    per_slot += row_bytes * k
                else:
                    fixed += row_bytes * k * gate
                slots = min(slots, max(1, (budget_bytes // 2 - fixed) // per_slot))
        snapshots = (0 if not config.enable_prefix_caching else
                     explicit_snapshots if explicit_snapshots is not None else slots)
        verify = k * (slots if gate is None else min(slots, gate))
        size = cls(slots, snapshots, row_bytes, verify)
        if budget_bytes is not None and size.total_bytes >= budget_bytes:
            raise ValueError(
                f"the hybrid model's state ({slots} slots + {snapshots} snapshots + {verify} "
                f"speculative verify rows of {row_bytes / 2**20:.1f} MiB) does not fit the KV "
                f"cache budget ({budget_what}); raise the memory or lower --max-num-seqs")
        return size

    def describe(self) -> str:
        verify = (f" + {self.num_verify_rows} speculative verify rows" if self.num_verify_rows
                  else "")
        return (f"{self.num_slots} state slots + {self.num_snapshots} prefix snapshots{verify} "
                f"of {self.row_bytes / 2**20:.2f} MiB each ({self.total_bytes / 2**20:.1f} MiB)")
