"""CUDA Graphs for decode steps (issue 4, item 4).

A decode step of a small batch is a few hundred short kernels; launching them one by one from
Python costs more than running them. A CUDA graph records the whole forward once and replays it
with one launch. A graph replays fixed work on fixed addresses, so:

- **Buckets.** One graph per batch size in `capture_sizes(max_num_seqs)`: 1, 2, 4, 8, then every 8
  up to max_num_seqs (as vLLM: fine steps where decode is launch-bound, coarser steps where
  the padding is a small fraction of a large batch). A batch of B sequences replays the smallest
  bucket >= B, its extra rows padded.
- **Static inputs.** A graph reads its batch arrays from buffers whose addresses it baked in. One
  int32 device buffer holds every bucket's inputs (each bucket has its own packed layout at the
  start of it, `input_layout`): token_ids, positions, slot_mapping, query_start_loc, seq_lens,
  block_table_rows and logits_indices, a few ints per row. A step packs the padded arrays into
  one pinned host buffer and fills the device buffer with ONE async copy of just that bucket's
  prefix, then launches.
- **Block tables** are not copied: the device keeps the persistent block tables
  (engine/runner/device_block_tables.py: the host's rows, updated each step by a small scatter of the
  step's new blocks, applied by ModelRunner.execute before the launch), and each graph begins
  with a gather of its bucket's rows, `table[block_table_rows, :max_blocks_per_seq]`, into a
  (size, max_blocks_per_seq) table of the graph's pool that the attention kernels read. So a
  step's copy no longer grows with max_model_len (it used to carry a (size, max_blocks) table:
  8 MiB a step for 256 sequences at 128k tokens). The graphs bake in the device table's address:
  `capture` reserves it at (max_num_seqs rows, max_blocks_per_seq) first, which the host table
  never outgrows (it takes back the rows of finished and preempted sequences before growing);
  should it be reallocated anyway, `can_run` turns false and decode runs eagerly (logged).
  Positions and slot mappings stay computed on the host and copied: unlike a block table they
  change for every sequence every step, so a device-resident copy would still take B new values
  a step; deriving them in the graph from seq_lens and the table would save 8 bytes a sequence
  (2 KiB at 256) for two more kernels and a second definition of the slot beside prepare's.
- **Padding rows** are all-zero decode rows that write slot -1 (the KV contract's "do not write",
  DESIGN.md section 5), so they never touch a live sequence's cache; their block-table row is
  the device table's zero row, and they read a context of length 1 from key 0 of block 0
  (always a valid address; whatever is there, their output rows are dropped: rows never mix in a
  forward). The decode kernel reads only the first ceil(seq_len / block_size) entries of a row.

- **Verify steps** (KernelConfig graphs_verify=on): speculative decoding's target forward scores
  k + 1 rows of every sequence. Buckets are keyed (size, query_len): besides the decode graphs
  (query_len 1) the runner captures every size at query_len k + 1, whose static inputs have
  size * (k + 1) token rows and query_start_loc = arange(size + 1) * (k + 1). Since T != B the
  attention takes the paged prefill kernel with its causal mask, whose grid depends on T and B
  alone (no host-side tile list). A step replays such a graph only when every sequence verifies
  exactly k drafts, every row sampled (`uniform_query_len`); padding sequences have k + 1 rows at
  positions 0..k, context k + 1, slot -1.
- **Uneven verify steps** (the same switch): a decode-only step whose sequences verify between 0
  and k drafts (n-gram misses, the adaptive policy turning a sequence down, a plain decode in the
  step) replays the (size, k + 1) graph too, each sequence's rows padded at its end to k + 1
  (`spread_rows`). The filler rows are never sampled: `run` hands back only the real rows' logits
  (and hidden states), in the eager layout, so the rejection sampler sees exactly the eager step:
  greedy tokens, seeded draws and logprobs as eager. (Verifying filler drafts as a deterministic
  proposer's, one-hot draft distribution, would be exact in distribution too, but it needs KV
  slots the scheduler never allocated for them, draws random numbers for their rows, so a seeded
  request's tokens would change, and changes the acceptance counters and the adaptive policy;
  dropping them changes nothing.) They cannot change a real row either: they come after every real
  row of their sequence (causal attention: no real row reads them), write no KV (slot -1), repeat
  the sequence's last real token and position (an in-range rotary position), and rows never mix in
  a forward. Their context runs past the sequence's by their number, so a sequence padded past the
  graphs' block-table width (max_blocks_per_seq * block_size tokens) runs the step eagerly. Steps
  with prompt chunks (a chunk samples only its last row) stay eager.
- **LoRA adapter rows** (graphs_lora=on): each bucket's static inputs end with a slot per row
  (lora_slots, -1 for the base model and the padding), which the projections read on the device
  during capture (Backend.lora_linear_slots; on CUDA the shrink and expand kernels of
  cuda/lora.cu). The adapters' weights stay in their fixed slots (engine/lora/slots.py), copied in
  by LoraManager.begin before the launch, so one graph per bucket serves any mix of adapters and
  base rows. Without it a step with adapter rows runs eagerly (`can_run`).

- **Tensor- and pipeline-parallel ranks** (KernelConfig graphs_parallel=on): every rank captures
  the same buckets in the same order (the builder checks), its NCCL all-reduces and all-gather
  captured inside (NCCL supports capture on the capturing stream). The collectives of a replay
  must match the other ranks' in count and size, so the ranks never choose for themselves: rank 0
  chooses (`choose`) and sends the bucket with the step (StepInputs.graphs), every rank replays
  that one (`run(batch, key)`), and a rank that cannot (its device table moved) runs the bucket's
  padded rows eagerly, which calls the same collectives with the same sizes. A pipeline stage
  captures its own layers; the residual stream is received into the graph's input rows before
  the replay and sent from its output rows after it (engine/parallel/pipeline.py,
  DeferredHandOver, says why around rather than inside), one replay per micro-batch.

Memory. Everything a graph touches must stay allocated, at the same address, for the graph's
life, and nobody else may reuse it while the graph could still write it:
- Allocations made during warm-up and capture (the forward's temporaries: gathered rows, the
  logits it returns, backend scratch) come from a private memory pool (`backend.new_graph_pool`,
  as PyTorch's torch.cuda.graph(pool=...)). Only later captures allocate from it, so temporaries
  freed inside one graph are reused only by other graphs' temporaries, which never run at the
  same time; the eager path can never be handed memory a graph writes.
- The model's activation Workspace grows on demand and frees its old buffer when it does (an
  eager prefill bigger than any capture would), so graphs get their own Workspace, swapped in
  around the captured forward and kept by the runner.
- Graphs are captured from the largest bucket to the smallest: the largest grows the workspace
  and the pool to their peak, and the smaller ones fit in the blocks it freed.
- Outputs: keeping every bucket's own logits array alive would cost sum(sizes) * vocab floats
  (2.2 GB for 256 sequences of a 128k vocabulary). Instead every graph ends with a copy of its
  logits into one static (max_num_seqs, vocab) buffer; `run` returns a view of its first B rows,
  valid until the next step (the engine samples from it first). The copy is B * vocab floats,
  about a microsecond at batch 1. (A model forward with an `out=` for the logits would remove it.)
- Hidden states for a speculative head (`hidden_capture`: EAGLE-3's AuxCapture, an MTP head's
  FinalCapture, engine/models/llama.py): the captured forward fills the capture with the rows'
  hidden states, a pool temporary like its logits, so every graph also copies them into one
  static (max rows, width) buffer, and `run` hands the proposer a view of its first B * q rows
  as `capture.states`, the shape and rows the eager forward sets. Plain decode steps replay
  such graphs too: the head reads every step's states.
- Reserving it: the engine sizes the KV pool AFTER subtracting `estimate_graph_memory_bytes(...)`
  (a conservative estimate, since the graphs bake in the pool's pointers and so are captured
  after it exists); `capture` then measures the private pool (`graph_memory_bytes`) so the log
  shows the estimate against the real figure. `--disable-cuda-graph` is the engine's business:
  it simply creates no runner.

The runner reaches the GPU only through the backend (methods listed on CudaGraphRunner), so its
bookkeeping is tested on the CPU with a fake backend whose "graph" replays the captured callable.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import logging

import numpy as np

from engine.runner.forward_batch import ForwardBatch

log = logging.getLogger("taper.engine")

MiB = 1 << 20
GRAPH_OVERHEAD_BYTES = 16 * MiB   # per captured graph: graph exec, cuBLAS and scratch headroom
_ALIGN = 16                       # int32 elements: each static input starts on a 64-byte boundary

# The static inputs, in ForwardBatch's field order (the block tables are gathered on the device),
# then, in graphs that cover LoRA adapters, each row's adapter slot (-1: the base model).
FIELDS = ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
          "block_table_rows", "logits_indices", "lora_slots")


# ---- buckets and padding (host side, pure NumPy)

def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs, which is always the last size."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 8)
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size >= num_seqs (sizes ascending); None past the largest."""
    if num_seqs < 1:
        raise ValueError(f"a decode batch has at least one sequence, got {num_seqs}")
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def uniform_query_len(batch: ForwardBatch) -> int | None:
    """q when every sequence computes q tokens (T == q B) and every row is sampled in order (a
    decode step: q = 1; a speculative verify step with k drafts for every sequence: q = k + 1);
    else None. Host arrays."""
    B, T = batch.num_seqs, batch.num_tokens
    if B == 0 or T % B or len(batch.logits_indices) != T:
        return None
    q = T // B
    if not (np.array_equal(batch.query_start_loc, np.arange(B + 1) * q)
            and np.array_equal(batch.logits_indices, np.arange(T))):
        return None
    return q


def verify_row_counts(batch: ForwardBatch, max_query_len: int) -> np.ndarray | None:
    """Each sequence's rows when every sequence computes 1 to max_query_len rows, every row
    sampled in order (a decode-only step, some sequences verifying drafts); else None (a prompt
    chunk samples only its last row). Host arrays."""
    B, T = batch.num_seqs, batch.num_tokens
    if B == 0 or len(batch.logits_indices) != T:
        return None
    counts = np.diff(np.asarray(batch.query_start_loc))
    if (len(counts) != B or counts.min() < 1 or counts.max() > max_query_len
            or not np.array_equal(batch.logits_indices, np.arange(T))):
        return None
    return counts


def spread_rows(batch: ForwardBatch, counts: np.ndarray, query_len: int):
    """A decode-only step of uneven rows laid out as query_len rows a sequence: (token_ids,
    positions, slot_mapping, seq_lens, real) for the first B * query_len rows of a verify graph,
    real being where the batch's own rows land. Each sequence's filler rows follow its real ones,
    repeat its last token and position and write no KV (-1); its context grows by their number,
    so the attention's causal diagonal (p = seq_len - (q_len - i)) still puts every real row at
    its own position."""
    B, q = batch.num_seqs, query_len
    starts = np.asarray(batch.query_start_loc[:B], np.int64)
    real = (np.repeat(np.arange(B) * q - starts, counts) + np.arange(batch.num_tokens))
    last = starts + counts - 1                    # each sequence's last real row in the batch
    spread = {name: np.repeat(np.asarray(getattr(batch, name))[last], q).astype(np.int32)
              for name in ("token_ids", "positions")}
    for name in spread:
        spread[name][real] = getattr(batch, name)
    slots = np.full(B * q, -1, np.int32)
    slots[real] = batch.slot_mapping
    seq_lens = (np.asarray(batch.seq_lens) + (q - counts)).astype(np.int32)
    return spread["token_ids"], spread["positions"], slots, seq_lens, real.astype(np.int32)


def is_pure_decode(batch: ForwardBatch) -> bool:
    """Every sequence computes exactly one token (T == B) and samples it. Host arrays."""
    return uniform_query_len(batch) == 1


def input_layout(size: int, query_len: int = 1,
                 lora: bool = False) -> tuple[dict[str, tuple[int, tuple]], int]:
    """Where each static input of a bucket of `size` sequences of `query_len` tokens lives in the
    packed int32 buffer: ({name: (offset, shape)}, number of int32 elements up to the end of the
    last one). lora: the graphs cover adapter rows (a slot per row)."""
    T = size * query_len
    shapes = {"token_ids": (T,), "positions": (T,), "slot_mapping": (T,),
              "query_start_loc": (size + 1,), "seq_lens": (size,),
              "block_table_rows": (size,), "logits_indices": (T,), "lora_slots": (T,)}
    layout, end = {}, 0
    for name in FIELDS if lora else FIELDS[:-1]:
        offset = -(-end // _ALIGN) * _ALIGN
        layout[name] = (offset, shapes[name])
        end = offset + int(np.prod(shapes[name]))
    return layout, end


def _views(buffer, layout: dict) -> dict:
    """The static inputs as views (NumPy or CuPy) of a packed 1-D int32 buffer."""
    return {name: buffer[off:off + int(np.prod(shape))].reshape(shape)
            for name, (off, shape) in layout.items()}


def _check_fits(batch: ForwardBatch, size: int, query_len: int, max_blocks: int,
                uneven: bool = False) -> None:
    if not uneven and uniform_query_len(batch) != query_len:
        what = ("a pure decode batch" if query_len == 1 else
                f"a verify batch of {query_len} tokens for every sequence, all sampled")
        raise ValueError(f"not {what} ({batch.num_tokens} tokens for {batch.num_seqs} "
                         f"sequences, logits rows {np.asarray(batch.logits_indices).tolist()[:8]})"
                         + (": every sequence must compute exactly one token and sample it"
                            if query_len == 1 else ""))
    if batch.num_seqs > size:
        raise ValueError(f"{batch.num_seqs} sequences do not fit a graph of {size} rows")
    if batch.block_table_rows is None:
        raise ValueError("the batch has no block_table_rows: the decode graphs gather the block "
                         "tables on the device from the persistent table's rows")
    if batch.block_table_width > max_blocks:
        raise ValueError(f"block tables are {batch.block_table_width} blocks wide, more than "
                         f"the graphs' max_blocks={max_blocks}")


def _write_inputs(views: dict, size: int, query_len: int, zero_row: int,
                  batch: ForwardBatch | None = None, spread=None):
    """Every element of a bucket's static inputs: the batch's rows, then padding rows (all
    padding when batch is None). A padding sequence has query_len rows at positions 0, 1, ...
    that write no KV slot (-1) and attend to the first keys of block 0 (its context is its own
    query_len rows, in the device table's zero row); their output rows are dropped. In graphs
    that cover LoRA, each row's adapter slot: -1 (the base model) but for the batch's adapter
    rows. spread: `spread_rows`'s layout of a batch of uneven rows."""
    B = 0 if batch is None else batch.num_seqs
    q = query_len
    T = B * q
    if spread is not None:
        (views["token_ids"][:T], views["positions"][:T], views["slot_mapping"][:T],
         views["seq_lens"][:B], _) = spread
        views["block_table_rows"][:B] = batch.block_table_rows
    elif B:
        views["token_ids"][:T] = batch.token_ids
        views["positions"][:T] = batch.positions
        views["slot_mapping"][:T] = batch.slot_mapping
        views["seq_lens"][:B] = batch.seq_lens
        views["block_table_rows"][:B] = batch.block_table_rows
    views["token_ids"][T:] = 0
    views["positions"][T:] = np.tile(np.arange(q, dtype=np.int32), size - B)
    views["slot_mapping"][T:] = -1
    views["seq_lens"][B:] = q
    views["block_table_rows"][B:] = zero_row
    views["query_start_loc"][:] = np.arange(size + 1, dtype=np.int32) * q
    views["logits_indices"][:] = np.arange(size * q, dtype=np.int32)
    if "lora_slots" in views:
        lora_slots = views["lora_slots"]
        lora_slots[:] = -1
        if batch is not None and batch.lora is not None:
            if spread is None:
                batch.lora.write_slot_of_rows(lora_slots)
            else:                   # the real rows' slots; the filler rows' output is dropped
                own = np.full(batch.num_tokens, -1, np.int32)
                batch.lora.write_slot_of_rows(own)
                lora_slots[spread[4]] = own


def pad_decode_inputs(batch: ForwardBatch, size: int, max_blocks: int, zero_row: int,
                      query_len: int = 1, lora: bool = False) -> dict[str, np.ndarray]:
    """The static-input contents of a bucket of `size` sequences of `query_len` tokens for a
    batch of that many tokens per sequence (host arrays): token_ids/positions padded with 0
    (positions 0, 1, ... for query_len > 1), slot_mapping with -1, seq_lens with query_len,
    query_start_loc = arange(size + 1) * query_len, block_table_rows padded with zero_row (the
    device table's all-zero row), logits_indices = arange(size * query_len), and with lora each
    row's adapter slot (-1: none). ValueError if the batch does not fit (more sequences than
    `size`, wider than max_blocks, not query_len tokens for every sequence)."""
    _check_fits(batch, size, query_len, max_blocks)
    layout, n = input_layout(size, query_len, lora)
    views = _views(np.zeros(n, np.int32), layout)
    _write_inputs(views, size, query_len, zero_row, batch)
    return views


def estimate_graph_memory_bytes(max_num_seqs: int, max_blocks_per_seq: int,
                                model_config=None, query_lens=(1,), lora: bool = False,
                                capture_width: int = 0) -> int:
    """Device memory to reserve for the decode graphs before the KV pool is sized: a conservative
    16 MiB per captured graph (graph exec objects, cuBLAS and attention scratch), the static
    inputs, the device block table reserved at capture (max_num_seqs + 1 rows of
    max_blocks_per_seq ids) and the largest graph's gather of it (max_num_seqs rows), and,
    given the model's config, the memory that grows with the largest graph's rows (max_num_seqs
    times the longest query_len): the static logits plus the forward's own logits (2 * vocab
    floats a row), and the graphs' activation workspace with the gathered rows (bounded by
    18 * hidden + 3 * intermediate floats a row, which covers q_size <= 2 * hidden).
    query_lens: the tokens per sequence graphs are captured for (1: decode; k + 1: verify
    steps); lora: they cover adapter rows; capture_width: the hidden-state columns a
    speculative head reads from every row (EAGLE-3: hidden times its aux layers; MTP: hidden),
    held twice (the forward's own and the static copy). An estimate: `CudaGraphRunner.capture`
    measures the real figure (graph_memory_bytes) and the engine logs both."""
    sizes = capture_sizes(max_num_seqs)
    max_q = max(query_lens)
    _, n = input_layout(max_num_seqs, max_q, lora)
    tables = (max_num_seqs + 1 + max_num_seqs) * max_blocks_per_seq
    total = len(sizes) * len(query_lens) * GRAPH_OVERHEAD_BYTES + 4 * (n + tables)
    if model_config is not None:
        per_row = (2 * model_config.vocab_size + 18 * model_config.hidden_size
                   + 3 * model_config.intermediate_size + 2 * capture_width)
        total += 4 * per_row * max_num_seqs * max_q
    return total


# ---- the runner

class _Bucket:
    __slots__ = ("size", "query_len", "num_ints", "host", "batch", "lora_slots", "logits",
                 "states", "graph", "stream_in", "stream_out")

    def __init__(self, size, query_len, num_ints, host, batch, lora_slots, logits, states):
        self.size = size
        self.query_len = query_len
        self.num_ints = num_ints   # int32 elements copied to the device per step
        self.host = host           # {name: view of the pinned host buffer}
        self.batch = batch         # ForwardBatch of views of the static device buffer
        self.lora_slots = lora_slots   # (size * query_len,) view of it, or None without LoRA
        self.logits = logits       # (size * query_len, V) view of the static logits
        self.states = states       # (size * query_len, width) view of the static hidden states
        self.graph = None
        # a pipeline stage's residual stream: received into before a replay (None on the first
        # stage), sent on from after it (None on the last); views of the graphs' workspace
        self.stream_in = None
        self.stream_out = None


class CudaGraphRunner:
    """Captures one decode graph per bucket and replays them.

    The backend provides (CudaBackend on the GPU; a NumPy fake in tests/test_cuda_graph.py):
      xp                           the array module of device arrays (cupy)
      asarray(a)                   a host array on the device (the real rows of a padded step)
      new_graph_pool()             a private device memory pool, with total_bytes()
      use_graph_pool(pool)         context manager: device allocations inside come from pool
      capture_graph(fn)            calls fn() under stream capture on backend.stream and returns
                                   a graph whose launch() replays the captured work on that stream
      pinned_empty(n, dtype)       a NumPy array of n elements in page-locked host memory
      copy_to_device_async(dst, src)  enqueue a host-to-device copy on backend.stream
      synchronize()                wait for backend.stream
      memory_info()                (free, total) bytes of the device, for the device-wide figure
    `block_tables` is the device's copy of the persistent block tables
    (engine/runner/device_block_tables.py) whose rows the batches name.

    query_lens: the tokens per sequence a bucket is captured for, each with every size: 1 (decode)
    and, for speculative decoding's verify steps (KernelConfig graphs_verify=on), k + 1. A bucket
    is keyed (size, query_len); a verify graph's attention is the paged prefill kernel with its
    causal mask (T != B), whose grid depends on T and B alone.
    lora_step: the LoraManager's LoraStep (engine/lora/slots.py) when the graphs cover adapter
    rows (KernelConfig graphs_lora=on): each bucket then has a static slot per row, which the
    projections read on the device during capture (Backend.lora_linear_slots), so one graph
    serves any mix of adapters and base rows; the adapters' weights stay in their fixed slots.

    capture (kept as `hidden_capture`): an AuxCapture (EAGLE-3) or FinalCapture (MTP) that every
    forward fills with the rows' hidden states for a speculative head (ModelRunner.aux_capture),
    or None; `run` then sets its `states` to the replayed rows', a view of a static buffer valid
    until the next run.
    block_size: the KV cache's; given, a decode-only step of uneven verify rows (0 to k drafts a
    sequence) replays the verify graph, its rows padded (`spread_rows`).

    Usage: capture() once after the KV caches exist; then per step, once the batch's
    block-table update is applied (ModelRunner.execute does it), if can_run(batch):
    logits = run(batch). `batch` is the host batch (ModelRunner.prepare's NumPy arrays).
    """

    def __init__(self, model, backend, kv_caches, max_num_seqs: int, max_blocks_per_seq: int,
                 block_tables, query_lens=(1,), lora_step=None, capture=None,
                 block_size: int | None = None):
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        if block_tables is None:
            raise ValueError("decode graphs need the device's block tables (DeviceBlockTables)")
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"query_lens must be tokens per sequence >= 1, got {query_lens}")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_tables = block_tables
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = sorted(set(query_lens))
        self.lora_step = lora_step
        self.hidden_capture = capture
        # uneven verify steps pad to the verify graph (none without one, or without the block
        # size that bounds how far the filler rows' context may run)
        self.pad_query_len = (max(self.query_lens) if max(self.query_lens) > 1
                              and block_size is not None else None)
        self.max_context = None if block_size is None else max_blocks_per_seq * block_size
        self.num_padded_replays = 0
        # a pipeline stage's model (engine/parallel/pipeline.py): its graphs hold its layers,
        # the residual stream handed over around each replay
        self.stage = getattr(getattr(model, "config", None), "pipeline", None)
        self.num_eager_fallbacks = 0         # steps rank 0 named a bucket this rank ran eagerly
        self.buckets: dict[tuple[int, int], _Bucket] = {}    # by (size, query_len)
        self.graph_memory_bytes = 0          # the private pool after capture
        self.device_memory_bytes = None      # free device memory before - after the capture
        self.num_replays = 0
        self._pool = None
        self._host = None                    # pinned int32 staging buffer
        self._device = None                  # static int32 input buffer
        self._logits = None                  # static (max_num_seqs * max query_len, V) output
        self._states = None                  # ... and (those rows, width) hidden states
        self._workspace = None               # the graphs' own activation workspace
        self._table = None                   # the device block table the graphs gather from
        self._zero_row = None                # ... and its all-zero row, the padding rows' row
        self._outputs_known = False          # the largest bucket's forward gave the outputs' shapes
        self._warned_table = False

    @property
    def captured(self) -> bool:
        return bool(self.buckets) and all(b.graph is not None for b in self.buckets.values())

    @property
    def covers_lora(self) -> bool:
        return self.lora_step is not None

    def _layout(self, size: int, query_len: int):
        return input_layout(size, query_len, self.covers_lora)

    # ---- capture

    def capture(self) -> None:
        if self.buckets:
            raise RuntimeError("CudaGraphRunner.capture() runs once")
        b = self.backend
        xp = b.xp
        _, total = self._layout(self.max_num_seqs, max(self.query_lens))
        free_before = b.memory_info()[0]
        # The graphs bake in the table's address: give it its final size now.
        self.block_tables.reserve(self.max_num_seqs, self.max_blocks_per_seq)
        self._table, self._zero_row = self.block_tables.table, self.block_tables.zero_row
        self._pool = b.new_graph_pool()
        self._host = b.pinned_empty(total, np.int32)
        ws = getattr(self.model, "workspace", None)
        if ws is not None:
            dtype = getattr(getattr(self.model, "backend", b), "act_dtype", np.float32)
            self._workspace = type(ws)(getattr(self.model, "xp", xp), dtype)
        # the most rows first: it grows the workspace and the pool to their peak
        keys = sorted(((size, q) for q in self.query_lens for size in self.sizes),
                      key=lambda k: (k[0] * k[1], k[1]), reverse=True)
        with b.use_graph_pool(self._pool):
            self._device = xp.empty(total, np.int32)
            for size, q in keys:
                self._capture_one(size, q)
        b.synchronize()
        self.graph_memory_bytes = int(self._pool.total_bytes())
        self.device_memory_bytes = int(free_before - b.memory_info()[0])
        log.debug("decode graphs for %s x query lengths %s: private pool %d bytes", self.sizes,
                  self.query_lens, self.graph_memory_bytes)

    def _capture_one(self, size: int, query_len: int) -> None:
        b, xp = self.backend, self.backend.xp
        layout, n = self._layout(size, query_len)
        host = _views(self._host, layout)
        device = _views(self._device, layout)
        lora_slots = device.pop("lora_slots", None)
        batch = ForwardBatch(block_tables=None, block_table_width=self.max_blocks_per_seq,
                             **device)
        _write_inputs(host, size, query_len, self._zero_row)     # a dummy batch: all padding
        b.copy_to_device_async(self._device[:n], self._host[:n])
        if not self._outputs_known:                               # the largest bucket: learn V
            self._outputs_known = True
            with self._hand_over_deferred(zero=True):
                first = self._forward(self._inputs(batch), lora_slots)
            rows = self.max_num_seqs * max(self.query_lens)
            if first is not None:   # (a stage before the last has none: it sends its stream on)
                self._logits = xp.empty((rows, first.shape[1]), first.dtype)
            if self.hidden_capture is not None:
                states, self.hidden_capture.states = self.hidden_capture.states, None
                self._states = xp.empty((rows, states.shape[1]), states.dtype)
                del states
            del first
        T = size * query_len
        bucket = _Bucket(size, query_len, n, host, batch, lora_slots,
                         None if self._logits is None else self._logits[:T],
                         None if self._states is None else self._states[:T])
        # Warm-up, eagerly: grows the workspace and the pool to this size, loads cuBLAS and
        # compiles CuPy's kernels, none of which may happen during capture.
        self._step(bucket, True)
        bucket.graph = b.capture_graph(functools.partial(self._step, bucket, False))
        # The next bucket rewrites the pinned buffer: this bucket's copy must have landed.
        b.synchronize()
        self.buckets[size, query_len] = bucket

    @contextlib.contextmanager
    def _hand_over_deferred(self, zero: bool):
        """On a pipeline stage: the forward's receive and send of the residual stream recorded
        instead of made (the replay makes them around the graph: `run`); zero: the received
        array is zeroed (the eager warm-up, which must not compute on a stale stream), never
        inside a capture (the graph would zero what the replay received). Elsewhere nothing."""
        if self.stage is None:
            yield None
            return
        with self.stage.hand_over_deferred(zero) as hand_over:
            yield hand_over

    def _forward(self, batch: ForwardBatch, lora_slots=None):
        """The model's forward on the graphs' own workspace (the eager one may grow later and
        free what a graph writes), its projections reading the adapter slots of the rows from
        `lora_slots` (a static device array) in graphs that cover LoRA."""
        if self.lora_step is not None:
            self.lora_step.slot_of_row = lora_slots
        eager = getattr(self.model, "workspace", None)
        if self._workspace is not None:
            self.model.workspace = self._workspace
        try:
            if self.hidden_capture is None:
                return self.model.forward(batch, self.kv_caches)
            return self.model.forward(batch, self.kv_caches, capture=self.hidden_capture)
        finally:
            if self._workspace is not None:
                self.model.workspace = eager
            if self.lora_step is not None:
                self.lora_step.slot_of_row = None

    def _inputs(self, batch: ForwardBatch) -> ForwardBatch:
        """The forward's inputs: the static ones, and the block tables gathered from the device
        table by the bucket's rows (a device op: inside a graph, it is replayed too)."""
        tables = self._table[batch.block_table_rows, :self.max_blocks_per_seq]
        return ForwardBatch(batch.token_ids, batch.positions, batch.slot_mapping,
                            batch.query_start_loc, batch.seq_lens, tables, batch.logits_indices)

    def _step(self, bucket: _Bucket, warm_up: bool) -> None:
        """What a graph holds: the gather of its rows' block tables, the forward, its logits
        (and the captured hidden states) copied to the static outputs (the forward's own arrays
        and the gathered tables are pool temporaries, so the capture drops its reference). On a
        pipeline stage, the arrays its stream arrives in and leaves from, kept by the bucket."""
        xp = self.backend.xp
        with self._hand_over_deferred(zero=warm_up) as hand_over:
            rows = self._forward(self._inputs(bucket.batch), bucket.lora_slots)
        if hand_over is not None:
            bucket.stream_in, bucket.stream_out = hand_over.received, hand_over.sent
        if bucket.logits is not None:
            xp.copyto(bucket.logits, rows)
        if bucket.states is not None:
            xp.copyto(bucket.states, self.hidden_capture.states)
            self.hidden_capture.states = None

    # ---- replay

    def can_run(self, batch: ForwardBatch) -> bool:
        """A captured graph fits the batch: q tokens for every sequence, all sampled, with q a
        captured query length (a verify graph only for a batch of neither a hybrid model's
        state rows nor images), at most max_num_seqs sequences, tables no wider than the
        graphs', adapter rows only in graphs that cover them."""
        if not self.captured or batch.block_table_rows is None:
            return False
        q = uniform_query_len(batch)
        if q not in self.query_lens and self._uneven(batch) is not None:
            q = self.pad_query_len
        return (q in self.query_lens
                and (q == 1 or (batch.state_plan is None and batch.vision is None))
                and (batch.lora is None or self.covers_lora)
                and bucket_for(batch.num_seqs, self.sizes) is not None
                and batch.block_table_width <= self.max_blocks_per_seq
                and self._table_unmoved())

    def _uneven(self, batch: ForwardBatch) -> np.ndarray | None:
        """Each sequence's rows when the batch is a decode-only step of verify rows no graph was
        captured for (uneven, or all fewer than k + 1) that the verify graph takes padded: no
        sequence past k + 1 rows, no filler row's context past the graphs' block tables
        (max_context); else None."""
        if self.pad_query_len is None:
            return None
        counts = verify_row_counts(batch, self.pad_query_len)
        if counts is None:
            return None
        padded = np.asarray(batch.seq_lens) + (self.pad_query_len - counts)
        return counts if int(padded.max()) <= self.max_context else None

    def _table_unmoved(self) -> bool:
        """The device block table is still the one the graphs gather from. It is reserved for
        max_num_seqs running sequences and should never move; if it did (a bug in that bound),
        the graphs would gather stale rows from the old one, so decode runs eagerly from then
        on."""
        if self.block_tables.table is self._table:
            return True
        if not self._warned_table:
            self._warned_table = True
            log.warning("the device block table was reallocated after the decode graphs were "
                        "captured (%s -> %s): decode runs without CUDA graphs from now on (on a "
                        "rank other than 0, the padded rows of rank 0's bucket)",
                        self._table.shape, self.block_tables.table.shape)
        return False

    def choose(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The bucket (size, query_len) whose graph runs `batch`, or None: it runs eagerly.
        Under tensor and pipeline parallel the rank that prepared the step (rank 0) chooses and
        every rank replays what it chose (engine/parallel/steps.py, StepInputs.graphs): the
        graphs hold the collectives, which every rank must call with the same sizes in the same
        order."""
        if not self.can_run(batch):
            return None
        q = uniform_query_len(batch)
        if q not in self.query_lens:
            q = self.pad_query_len
        return bucket_for(batch.num_seqs, self.sizes), q

    def run(self, batch: ForwardBatch, key: tuple[int, int] | None = None):
        """Logits (T, V) of a batch of q tokens for every sequence (T = q B), by replaying its
        bucket's graph: a view of the static output, valid until the next run (the caller
        consumes it before the next step); with a `capture`, its states (T, width) likewise. With adapter rows (batch.lora), their slots must
        hold their adapters (LoraManager.begin) before the launch. A pipeline stage before the
        last returns None (its stream went on to the next stage).

        key: the bucket rank 0 chose (`choose`) for a tensor- or pipeline-parallel step. A rank
        that cannot replay it (its device table moved) runs the bucket's padded rows eagerly
        instead: the same collectives, of the same sizes, as its peers' graphs (a step of the
        batch's own rows would call them with other sizes, and the group would hang or fail).

        The pinned staging buffer is rewritten here while the previous step's copy could still be
        queued; that is safe because the engine waits for every step's results (it reads the
        sampled tokens back) before preparing the next one. A caller that does not must
        synchronize the backend between runs."""
        if not self.captured:
            raise RuntimeError("CudaGraphRunner.run before capture()")
        B = batch.num_seqs
        if key is None:
            size = bucket_for(B, self.sizes) if B else None
            if size is None:
                raise ValueError(f"{B} sequences: the decode graphs hold 1 to "
                                 f"{self.max_num_seqs}")
            q = uniform_query_len(batch)
            counts = None if q in self.query_lens else self._uneven(batch)
            if counts is not None:
                q = self.pad_query_len
            if q not in self.query_lens:
                q = self.query_lens[0]      # _check_fits names what the batch is not
        else:
            if tuple(key) not in self.buckets:
                raise ValueError(f"bucket {tuple(key)} was not captured on this rank (its "
                                 f"buckets: {sorted(self.buckets)})")
            size, q = key
            counts = None if uniform_query_len(batch) == q else self._uneven(batch)
        _check_fits(batch, size, q, self.max_blocks_per_seq, uneven=counts is not None)
        if batch.lora is not None and not self.covers_lora:
            raise ValueError("the batch has LoRA adapter rows: these graphs were captured "
                             "without adapters (KernelConfig graphs_lora=off)")
        replay = self._table_unmoved()
        if not replay and key is None:
            raise RuntimeError("the device block table moved after capture: run eagerly")
        bucket = self.buckets[size, q]
        spread = None if counts is None else spread_rows(batch, counts, q)
        _write_inputs(bucket.host, size, q, self._zero_row, batch, spread)
        n = bucket.num_ints
        self.backend.copy_to_device_async(self._device[:n], self._host[:n])
        if replay:
            if bucket.stream_in is not None:
                self.stage.receive_stream(bucket.stream_in)
            bucket.graph.launch()
            if bucket.stream_out is not None:
                self.stage.send_stream(bucket.stream_out)
            self.num_replays += 1
            logits, states = bucket.logits, bucket.states
        else:
            logits, states = self._run_padded_eagerly(bucket)
        if logits is None:
            return None
        if spread is None:
            if self.hidden_capture is not None:
                self.hidden_capture.states = states[:B * q]
            return logits[:B * q]
        # only the real rows, in the eager layout: the filler rows are never sampled
        self.num_padded_replays += 1
        real = self.backend.asarray(spread[4])
        if self.hidden_capture is not None:
            self.hidden_capture.states = states[real]
        return logits[real]

    def _run_padded_eagerly(self, bucket: _Bucket):
        """The bucket's static inputs (just written) through the forward without its graph, the
        block tables gathered from the device table as it is now: (logits or None, states or
        None), new arrays."""
        self.num_eager_fallbacks += 1
        if self.num_eager_fallbacks == 1:
            log.warning("this rank cannot replay the decode graph rank 0 chose; it runs the "
                        "graph's padded rows eagerly, in step with the other ranks")
        static = bucket.batch
        tables = self.block_tables.table[static.block_table_rows, :self.max_blocks_per_seq]
        batch = ForwardBatch(static.token_ids, static.positions, static.slot_mapping,
                             static.query_start_loc, static.seq_lens, tables,
                             static.logits_indices)
        logits = self._forward(batch, bucket.lora_slots)
        states = None
        if self.hidden_capture is not None:
            states, self.hidden_capture.states = self.hidden_capture.states, None
        return logits, states
