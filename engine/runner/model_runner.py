"""Turns a scheduler step into the flat batch arrays and runs one forward call for all of it."""
from __future__ import annotations

import itertools

import numpy as np

from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.forward_batch import ForwardBatch
from engine.runner.input_buffers import BlockTables
from engine.core.scheduler import SchedulerOutput


# KV cache element type per EngineConfig.kv_cache_dtype on the CPU: fp8 is OCP e4m3 codes (uint8)
# with the model's per-layer, per-KV-head scales (DESIGN.md section 5). Other backends name their
# own through `backend.kv_cache_dtype(kind)`.
KV_CACHE_DTYPES = {"auto": np.float32, "fp8": np.uint8}


class ModelRunner:
    def __init__(self, model, model_config, backend, block_size: int, num_blocks: int,
                 kv_cache_dtype: str = "auto"):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = model.kv_cache_shape(num_blocks, block_size)
        dtype = backend.kv_cache_dtype(kv_cache_dtype)
        xp = backend.xp
        self.kv_caches = [(xp.zeros(shape, dtype), xp.zeros(shape, dtype))
                          for _ in range(model_config.num_hidden_layers)]
        self.block_tables = BlockTables()   # persistent: updated with each step's new blocks
        # A backend whose arrays live apart from the host's (CUDA) keeps its own copy of the
        # tables, updated with each step's changes; on the CPU the host table is the device's.
        self.device_block_tables = (DeviceBlockTables(backend, self.block_tables)
                                    if backend.xp is not np else None)
        self.graph_runner = None      # a CudaGraphRunner once decode graphs are captured
        self.num_forward_calls = 0    # counted for tests and metrics
        self.num_forward_tokens = 0

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, kv_cache_dtype="auto") -> int:
        """kv_cache_dtype: a CPU kind ("auto", "fp8") or an element dtype."""
        dtype = KV_CACHE_DTYPES[kv_cache_dtype] if isinstance(kv_cache_dtype, str) else kv_cache_dtype
        itemsize = np.dtype(dtype).itemsize  # f32: 4, bf16/f16: 2, fp8: 1
        per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * itemsize  # K+V
        return per_token * block_size * model_config.num_hidden_layers

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        """Each sequence computes tokens [num_computed, num_computed + n) (its num_computed_tokens
        when scheduled); the scheduler marks those that reach their last token, whose last row is
        sampled. logits_indices: the sampled rows in sequence order, then the rows of prompt
        positions whose logprobs a request asked for (Sequence.prompt_logprob_positions), in
        sequence order. A row whose token is an output placeholder (scheduled ahead of the step
        that samples it: engine/core/scheduler.py) gets token id -1; the engine fills it before the
        forward (engine/core/placeholders.py). Positions, slots and tables never depend on it.

        One pass over the sequences for their scalars, array arithmetic for the per-token
        arrays, and the persistent block tables (engine/runner/input_buffers.py) for the tables: on a
        device that keeps them (engine/runner/device_block_tables.py) the batch carries the rows and
        the table's changes instead of a (B, width) table."""
        seqs, num_new_tokens = sched.seqs, sched.num_new_tokens
        B, bs = len(seqs), self.block_size
        n = np.array(num_new_tokens, np.int32)
        starts = np.array(sched.num_computed, np.int32)
        query_start_loc = np.zeros(B + 1, np.int32)
        np.cumsum(n, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        if total == B:      # one token each: the usual decode step
            seq_of_row = np.arange(B)
            positions = starts.copy()
            token_ids = np.fromiter((ids[p] if p < len(ids) else -1 for ids, p in
                                     zip((seq.token_ids for seq in seqs), sched.num_computed)),
                                    np.int32, B)
        else:
            seq_of_row = np.repeat(np.arange(B), n)
            positions = (np.arange(total, dtype=np.int32) - query_start_loc[seq_of_row]
                         + starts[seq_of_row])
            # a placeholder is a sequence's one new token, past its known ones; a verify step's
            # drafts follow its last known token (-1 until a draft model writes them)
            token_ids = np.fromiter(itertools.chain.from_iterable(
                (seq.token_ids[a:a + k - d] + (drafts or [-1] * d) if d else
                 seq.token_ids[a:a + k] if a < seq.num_tokens else (-1,))
                for seq, a, k, d, drafts in zip(seqs, sched.num_computed, num_new_tokens,
                                                sched.num_drafts, sched.drafts)),
                np.int32, total)
        width = max(len(seq.block_table) for seq in seqs)
        rows = self.block_tables.rows_for(seqs)    # may grow the table: index it after
        table = self.block_tables.table
        slot_mapping = table[rows[seq_of_row], positions // bs] * bs + positions % bs
        on_device = self.device_block_tables is not None
        block_tables = None if on_device else table[rows, :width]
        sampled = np.fromiter((s and seq.pooler is None for seq, s in zip(seqs, sched.sample)),
                              bool, B)
        logits_indices = query_start_loc[1:][sampled] - 1
        if sched.has_drafts:    # a verify step's rows all sample: its last 1 + k rows
            rows_per_seq = np.array(sched.num_drafts, np.int32)[sampled] + 1
            ends = np.repeat(logits_indices + 1, rows_per_seq)
            logits_indices = ends - (np.repeat(np.cumsum(rows_per_seq), rows_per_seq)
                                     - np.arange(int(rows_per_seq.sum()), dtype=np.int32))
        prompt_rows = [int(query_start_loc[i]) + p - a
                       for i, (seq, a, k) in enumerate(zip(seqs, sched.num_computed,
                                                           num_new_tokens))
                       if seq.wants_prompt_logprobs
                       for p in seq.request.prompt_logprob_positions(a, k)]
        if prompt_rows:
            logits_indices = np.concatenate([logits_indices, np.array(prompt_rows, np.int32)])
        return ForwardBatch(token_ids, positions, slot_mapping.astype(np.int32, copy=False),
                            query_start_loc, starts + n, block_tables,
                            logits_indices.astype(np.int32, copy=False),
                            rows.astype(np.int32), width,
                            self.block_tables.take_update() if on_device else None)

    def copy_blocks(self, pairs: list[tuple[int, int]]):
        """KV block src -> dst in every layer (a beam's fork of a partly filled block)."""
        if not pairs:
            return
        src = self.backend.asarray(np.array([p[0] for p in pairs], np.int64))
        dst = self.backend.asarray(np.array([p[1] for p in pairs], np.int64))
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @staticmethod
    def pooled_rows(sched: SchedulerOutput) -> list[tuple]:
        """(seq, chunk start, [first, end) batch rows) for each embedding request in the step:
        the rows its Pooler reads (its mode decides which)."""
        out, row = [], 0
        for seq, start, n in zip(sched.seqs, sched.num_computed, sched.num_new_tokens):
            if seq.pooler is not None:
                first, end = seq.pooler.rows_wanted(start, n)
                out.append((seq, start, row + first, row + end))
            row += n
        return out

    def to_device(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch's arrays on the backend, its block tables gathered there when the device
        keeps them (after the table's changes the batch carries)."""
        self._apply_table_update(batch)
        on_device = batch.map(self.backend.asarray)
        if on_device.block_tables is None:
            on_device.block_tables = self.device_block_tables.gather(
                on_device.block_table_rows, batch.block_table_width)
        return on_device

    def _apply_table_update(self, batch: ForwardBatch) -> None:
        """The device table's changes recorded with this batch, applied once (a speculative
        step's draft model reads the tables before the target's forward)."""
        if self.device_block_tables is not None and batch.block_table_update is not None:
            self.device_block_tables.apply(batch.block_table_update)
            batch.block_table_update = None

    def execute(self, sched: SchedulerOutput, batch: ForwardBatch | None = None):
        """One forward call; returns the logits (S + P, V) of the S sequences that sample this
        step, then of the P prompt-logprob rows (on the backend's device), and for each
        embedding request in the step (seq, chunk start, its pooled rows' final-norm hidden
        states as float32 on the host). Pure decode steps replay a captured CUDA graph when one
        fits. batch: this step's arrays when the caller prepared them already."""
        if batch is None:
            batch = self.prepare(sched)
        self._apply_table_update(batch)   # the table's changes, before anything reads it
        pooled = self.pooled_rows(sched)
        self.backend.adapt_threads()    # CPU: fewer threads while other processes compete
        self.num_forward_calls += 1
        self.num_forward_tokens += batch.num_tokens
        if not pooled:
            if self.graph_runner is not None and self.graph_runner.can_run(batch):
                return self.graph_runner.run(batch), []
            return self.model.forward(self.to_device(batch), self.kv_caches), []
        rows = np.concatenate([np.arange(first, end, dtype=np.int32)
                               for _, _, first, end in pooled])
        logits, hidden = self.model.forward(self.to_device(batch), self.kv_caches,
                                            hidden_indices=self.backend.asarray(rows))
        scores = self.token_logits(pooled, hidden)
        hidden = np.asarray(self.backend.to_host(hidden), dtype=np.float32)
        out, at = [], 0
        for seq, start, first, end in pooled:
            k = end - first
            rows_out = hidden[at:at + k]
            if seq.pooler.token_ids is not None:
                rows_out = scores.pop(0) if k else np.zeros((0, len(seq.pooler.token_ids)),
                                                           np.float32)
            out.append((seq, start, rows_out))
            at += k
        return logits, out

    def token_logits(self, pooled: list[tuple], hidden) -> list[np.ndarray]:
        """For each scoring request (its Pooler has token_ids) whose last row is in `hidden`, in
        order: those tokens' logits there, (1, len(token_ids)) float32 on the host. Their rows
        go through the lm_head together; only the asked-for logits leave the device."""
        wanted, at = [], 0
        for seq, _, first, end in pooled:
            if seq.pooler.token_ids is not None and end > first:
                wanted.append((at + end - first - 1, seq.pooler.token_ids))
            at += end - first
        if not wanted:
            return []
        be = self.backend
        rows = be.asarray(np.array([r for r, _ in wanted], np.int64))
        logits = self.model.logits(be.xp.ascontiguousarray(hidden[rows]))
        row_of = np.repeat(np.arange(len(wanted)), [len(ids) for _, ids in wanted])
        cols = np.concatenate([np.array(ids, np.int64) for _, ids in wanted])
        picked = np.asarray(be.to_host(logits[be.asarray(row_of), be.asarray(cols)]),
                            np.float32)
        return [p.reshape(1, -1)
                for p in np.split(picked, np.cumsum([len(ids) for _, ids in wanted])[:-1])]
