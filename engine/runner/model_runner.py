"""Turns a scheduler step into the flat batch arrays and runs one forward call for all of it."""
from __future__ import annotations

import itertools

import numpy as np

from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.forward_batch import ForwardBatch
from engine.runner.input_buffers import BlockTables
from engine.core.scheduler import SchedulerOutput
from engine.vision.runner import VisionRunner
from engine.parallel.steps import HostArrays, StepInputs


# KV cache element type per EngineConfig.kv_cache_dtype on the CPU: fp8 is OCP e4m3 codes (uint8)
# with the model's per-layer, per-KV-head scales (DESIGN.md section 5). Other backends name their
# own through `backend.kv_cache_dtype(kind)`.
KV_CACHE_DTYPES = {"auto": np.float32, "fp8": np.uint8}


class ModelRunner:
    def __init__(self, model, model_config, backend, block_size: int, num_blocks: int,
                 kv_cache_dtype: str = "auto", state_pool=None):
        """state_pool: a hybrid model's HybridBlockPool (engine/core/hybrid_state.py), which
        sizes its state rows and plans each step's use of them; None for other models."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.state_pool = state_pool
        dtype = backend.kv_cache_dtype(kv_cache_dtype)
        if state_pool is not None:
            self.kv_caches = model.allocate_caches(num_blocks, block_size, dtype,
                                                   state_pool.num_state_rows)
        else:
            self.kv_caches = model.new_kv_caches(num_blocks, block_size, dtype)
        self.block_tables = BlockTables()   # persistent: updated with each step's new blocks
        # A backend whose arrays live apart from the host's (CUDA) keeps its own copy of the
        # tables, updated with each step's changes; on the CPU the host table is the device's.
        self.device_block_tables = (DeviceBlockTables(backend, self.block_tables)
                                    if backend.xp is not np else None)
        self.graph_runner = None      # a CudaGraphRunner once decode graphs are captured
        # EAGLE-3 (engine/spec/eagle3.py): an AuxCapture every forward fills with the target's
        # aux hidden states; MTP (engine/spec/mtp.py): a FinalCapture (graphs fill it only
        # where captured with it: CudaGraphRunner.hidden_capture)
        self.aux_capture = None
        self.lora = None              # an engine.lora.manager.LoraManager (--enable-lora)
        self.num_forward_calls = 0    # counted for tests and metrics
        self.num_forward_tokens = 0
        # a vision-language model's image rows and encoder (engine/vision/runner.py)
        # (a model may name its own runner class: Gemma 3's keeps plain positions)
        self.vision = (getattr(model, "vision_runner", VisionRunner)(model, backend)
                       if getattr(model, "vision_encoder", None) is not None else None)
        self.peers = None             # rank 0 of a tensor-parallel group: a steps.StepSender
        self.pipeline = None          # a pipeline stage's rank: an engine.parallel.PipelineRunner
        self._block_copies: list[tuple[int, int]] = []   # for the peers, with the next step
        self._state_copies: list[tuple[list, list]] = []  # (src rows, dst rows): the same
        self._applied_update = None   # rank 0 of a group: the last table update applied

    def join_tensor_parallel(self, peers=None) -> None:
        """A rank of a tensor-parallel group (engine/parallel/steps.py), before its first step:
        rank 0 sends each step's inputs to `peers`. Every rank keeps its own copy of the block
        tables, so a batch carries the tables' changes, not whole tables (on the CPU too)."""
        if self.device_block_tables is None:
            self.device_block_tables = DeviceBlockTables(HostArrays(), self.block_tables)
        self.peers = peers

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, kv_cache_dtype="auto") -> int:
        """kv_cache_dtype: a CPU kind ("auto", "fp8") or an element dtype."""
        dtype = KV_CACHE_DTYPES[kv_cache_dtype] if isinstance(kv_cache_dtype, str) else kv_cache_dtype
        itemsize = np.dtype(dtype).itemsize  # f32: 4, bf16/f16: 2, fp8: 1
        per_token = model_config.kv_cache_elements_per_token * itemsize  # K+V, or MLA's latent
        return per_token * block_size * model_config.num_kv_layers

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
        batch = ForwardBatch(token_ids, positions, slot_mapping.astype(np.int32, copy=False),
                             query_start_loc, starts + n, block_tables,
                             logits_indices.astype(np.int32, copy=False),
                             rows.astype(np.int32), width,
                             self.block_tables.take_update() if on_device else None)
        if self.state_pool is not None:     # a hybrid model's state rows
            batch.state_plan = self.state_pool.plan(sched)
            batch.state_plan.asarray = self.backend.asarray
        if self.vision is not None:     # M-RoPE positions and image rows
            self.vision.prepare(sched, batch)
        if self.lora is not None:       # the adapter rows grouped by adapter, their slots
            batch.lora = self.lora.plan(seqs, query_start_loc)
        return batch

    def keep_verified_states(self, plan, emitted: dict[int, int]) -> None:
        """A hybrid model after a verify step (engine/core/hybrid_state.py, verify rows): each
        speculating sequence's state slot takes the state after its accepted drafts. emitted:
        seq_id -> tokens the step emits for it (its accepted drafts, then the drawn one); a
        sequence missing there (its request failed) is left alone."""
        src, dst = [], []
        for i, seq_id, k, first in plan.verify:
            n = emitted.get(seq_id)
            if n is not None and n - 1 < k:
                src.append(first + n - 1)
                dst.append(int(plan.slots[i]))
        if src:
            self.model.copy_state_rows(self.kv_caches, src, dst)
            if self.peers is not None:     # the other ranks copy theirs before the next step
                self._state_copies.append((src, dst))

    def copy_blocks(self, pairs: list[tuple[int, int]]):
        """KV block src -> dst in every layer (a beam's fork of a partly filled block); under
        tensor parallel the other ranks copy theirs before the next step."""
        if not pairs:
            return
        if self.peers is not None:
            self._block_copies.extend(pairs)
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
        step's draft model reads the tables before the target's forward). Rank 0 of a
        tensor- or pipeline-parallel group keeps them on the batch, which it sends to the other
        ranks only after the draft has read the tables."""
        update = batch.block_table_update
        if (self.device_block_tables is None or update is None
                or update is self._applied_update):
            return
        self.device_block_tables.apply(update)
        if self.peers is None:
            batch.block_table_update = None
        else:
            self._applied_update = update

    def execute(self, sched: SchedulerOutput, batch: ForwardBatch | None = None):
        """One forward call; returns the logits (S + P, V) of the S sequences that sample this
        step, then of the P prompt-logprob rows (on the backend's device), and for each
        embedding request in the step (seq, chunk start, its pooled rows' final-norm hidden
        states as float32 on the host). Decode steps (and, where captured, verify steps of k
        drafts for every sequence) replay a captured CUDA graph when one fits. batch: this
        step's arrays when the caller prepared them already. Under tensor parallel, rank 0
        sends the step's inputs to the other ranks first, which run the same forward
        (engine/parallel/steps.py)."""
        if batch is None:
            batch = self.prepare(sched)
        pooled = self.pooled_rows(sched)
        hidden_rows = scored = score_rows = None
        if pooled:
            hidden_rows = np.concatenate([np.arange(first, end, dtype=np.int32)
                                          for _, _, first, end in pooled])
            scored = self.scored_rows(pooled)
            if scored:
                score_rows = np.array([r for r, _ in scored], np.int64)
        inputs = StepInputs(batch, hidden_rows, score_rows, self._block_copies,
                            state_copies=self._state_copies)
        inputs.graphs = self.graph_plan(inputs)
        self._block_copies, self._state_copies = [], []
        if self.peers is not None:      # before the block table's update is applied and dropped
            sent = inputs if self.vision is None else self.vision.for_peers(inputs)
            self.peers.send(sent if self.lora is None else self.lora.for_peers(sent))
        logits, hidden, score_logits = self.run(inputs)
        if not pooled:
            return logits, []
        scores = self.pick_scores(scored, score_logits) if scored else []
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

    def run(self, inputs: StepInputs):
        """The device part of a step, the same on every tensor-parallel rank: (logits, the pooled
        rows' hidden states or None, the scored rows' logits or None)."""
        batch = inputs.batch
        self._apply_table_update(batch)   # the table's changes, before anything reads it
        if batch.state_plan is not None:  # (as rank 0 sent it: its index arrays on the host)
            batch.state_plan.asarray = self.backend.asarray
        self.backend.adapt_threads()    # CPU: fewer threads while other processes compete
        self.num_forward_calls += 1
        self.num_forward_tokens += batch.num_tokens
        if self.vision is not None:     # the step's images through the encoder (or its cache)
            self.vision.encode(batch)
        elif batch.vision is not None:  # a tensor-parallel rank past 0: rank 0's embeddings
            batch.vision.embeds = self.backend.asarray(batch.vision.embeds)
        # an EAGLE-3 head's features: the target's hidden states at its layers, every row
        capture = {} if self.aux_capture is None else {"capture": self.aux_capture}
        if batch.lora is None:
            return self._forward(inputs, capture)
        # Adapter rows: the projections add their deltas during this forward only; a graph
        # replays them only where it was captured over adapter slots (graphs_lora=on), else
        # the step runs eagerly (CudaGraphRunner.can_run).
        self.lora.begin(batch.lora)
        try:
            return self._forward(inputs, capture)
        finally:
            self.lora.end()

    def graph_plan(self, inputs: StepInputs) -> tuple | None:
        """The captured CUDA graphs the step replays: a bucket for each micro-batch (one without
        pipeline parallel; None where one runs eagerly), or None. Chosen here, where the step is
        prepared (rank 0), and sent with it: every rank replays the same buckets in the same
        order, since the graphs hold the collectives (engine/parallel/steps.py)."""
        graphs = self.graph_runner
        if (graphs is None or inputs.hidden_rows is not None
                or graphs.hidden_capture is not self.aux_capture):
            return None
        if self.pipeline is not None:
            return self.pipeline.plan(graphs, inputs)
        key = graphs.choose(inputs.batch)
        return None if key is None else (key,)

    def _forward(self, inputs: StepInputs, capture: dict):
        if self.pipeline is not None:       # the rank's stage over the step's micro-batches
            return self.pipeline.forward(self, inputs)
        batch = inputs.batch
        if inputs.hidden_rows is None:
            if inputs.graphs is not None:       # the bucket rank 0 chose (graph_plan)
                if self.graph_runner is None:
                    raise RuntimeError("rank 0 replays a CUDA graph for this step, but this "
                                       "rank captured none")
                return self.graph_runner.run(batch, inputs.graphs[0]), None, None
            return (self.model.forward(self.to_device(batch), self.kv_caches, **capture), None,
                    None)
        be = self.backend
        logits, hidden = self.model.forward(self.to_device(batch), self.kv_caches,
                                            hidden_indices=be.asarray(inputs.hidden_rows),
                                            **capture)
        score_logits = None
        if inputs.score_rows is not None:   # their rows go through the lm_head together
            score_logits = self.model.logits(
                be.xp.ascontiguousarray(hidden[be.asarray(inputs.score_rows)]))
        return logits, hidden, score_logits

    @staticmethod
    def scored_rows(pooled: list[tuple]) -> list[tuple[int, list[int]]]:
        """(row in the pooled hidden states, token ids) of each scoring request (its Pooler has
        token_ids) whose last row is in this step, in order."""
        wanted, at = [], 0
        for seq, _, first, end in pooled:
            if seq.pooler.token_ids is not None and end > first:
                wanted.append((at + end - first - 1, seq.pooler.token_ids))
            at += end - first
        return wanted

    def pick_scores(self, scored: list[tuple], logits) -> list[np.ndarray]:
        """For each scored row, its tokens' logits, (1, len(token_ids)) float32 on the host;
        only the asked-for logits leave the device."""
        be = self.backend
        row_of = np.repeat(np.arange(len(scored)), [len(ids) for _, ids in scored])
        cols = np.concatenate([np.array(ids, np.int64) for _, ids in scored])
        picked = np.asarray(be.to_host(logits[be.asarray(row_of), be.asarray(cols)]),
                            np.float32)
        return [p.reshape(1, -1)
                for p in np.split(picked, np.cumsum([len(ids) for _, ids in scored])[:-1])]
