"""The loaded LoRA adapters, the slots that hold them, and each step's rows grouped by adapter.

Adapters live in host memory (engine/lora/adapter.py) once loaded, by name. A step may run at
most --max-loras of them (the scheduler admits no more: engine/core/scheduler.py); each one it
runs gets a slot, chosen on the engine thread when the step is prepared (`plan`): the slot that
already holds it, else a free one, else the least recently used slot that this step does not use
(a swap). The weights are copied into the slot on the forward thread just before the step's
forward (`begin`), after every step prepared before it has run: so a slot taken from an adapter
the step in flight still uses is rewritten only once that step is done.

A step's rows are grouped by slot once (`plan`): the rows of the sequences that run an adapter,
sorted by slot, with the segment boundaries; every projection of every layer then runs one
segmented LoRA op over them (Backend.lora_linear). Rows of the base model take no part.

A split engine (tensor or pipeline parallel) has a manager on every rank, each holding its share
of every adapter (engine/lora/shards.py) and slots for its share of each projection. Rank 0 plans
the slots; its LoraBatch travels with the step (its adapters by id: `for_peers`), so every rank
writes the same slots at the same step. An adapter loaded on rank 0 is loaded on the others
before the load returns (`peers`: the StepSender, engine/parallel/steps.py), under rank 0's id;
one that rank 0 no longer holds (unloaded and no sequence left on it) is dropped on the others
with the next step (`retired`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from engine.lora.adapter import LoraAdapter, LoraError, read_adapter
from engine.lora.config import LoraConfig, check_lora_name
from engine.lora.slots import LoraStep, attach, slot_dtype

log = logging.getLogger("taper.lora")


@dataclass(slots=True)
class LoraBatch:
    """A step's adapter rows grouped by slot, and what each slot it uses must hold."""
    rows: np.ndarray          # (L,) int32: batch rows that run an adapter, slot by slot
    seg_offsets: np.ndarray   # (G+1,) int32: segment g is rows[seg_offsets[g]:seg_offsets[g+1]]
    seg_slots: np.ndarray     # (G,) int32: its slot
    adapters: list | None     # (G,) the LoraAdapter segment g's slot must hold
    # (G,) their ids: what the other ranks of a split engine get in place of `adapters` (None)
    adapter_ids: list | None = None

    def write_slot_of_rows(self, out: np.ndarray) -> None:
        """out[t] = the slot of batch row t, -1 for a row of the base model (`out` covers at
        least every row of the batch): the form a CUDA graph reads (engine/runner/cuda_graph.py),
        where the segments' sizes cannot change from one replay to the next."""
        out[:] = -1
        out[self.rows] = np.repeat(self.seg_slots, np.diff(self.seg_offsets))

    def between(self, start: int, stop: int) -> "LoraBatch | None":
        """The rows [start, stop) of the batch (a pipeline micro-batch), renumbered from
        start, grouped as here; None when none of them runs an adapter."""
        inside = (self.rows >= start) & (self.rows < stop)
        if not inside.any():
            return None
        counts = np.add.reduceat(inside.astype(np.int32), self.seg_offsets[:-1])
        kept = np.nonzero(counts > 0)[0]
        offsets = np.zeros(len(kept) + 1, np.int32)
        np.cumsum(counts[kept], out=offsets[1:])
        return LoraBatch((self.rows[inside] - start).astype(np.int32), offsets,
                         self.seg_slots[kept],
                         None if self.adapters is None else [self.adapters[g] for g in kept],
                         None if self.adapter_ids is None else
                         [self.adapter_ids[g] for g in kept])


class LoraManager:
    def __init__(self, config: LoraConfig, model, model_config, backend, dtype: str = "auto",
                 shard=None):
        """dtype: the engine's --dtype (auto: the checkpoint's), which the CPU slots follow;
        model_config: the whole model's; shard: the rank's share of a split engine
        (engine/lora/shards.py AdapterShard), whose model's config is its own."""
        self.config = config
        self.model_config, self.backend, self.shard = model_config, backend, shard
        self.step = LoraStep()
        self.dtype = slot_dtype(backend, model_config.dtype if dtype == "auto" else dtype)
        self.projections = attach(model, getattr(model, "config", model_config), backend,
                                  self.step, config.max_loras, config.max_lora_rank, self.dtype)
        self._supported: dict[int, set[str]] = {}
        for layer, projection in self.projections:
            self._supported.setdefault(layer, set()).add(projection)
        self._adapters: dict[str, LoraAdapter] = {}
        # a split engine's rank past 0: the adapters rank 0 holds, by rank 0's id
        self._by_id: dict[int, LoraAdapter] = {}
        self.peers = None           # rank 0 of a split engine: its StepSender
        self._retired = collections.deque()   # rank 0: ids of adapters gone since the last step
        self._lock = threading.Lock()        # the server loads and unloads from its threads
        # engine thread: which adapter each slot is given to, and when it was last used
        self._assigned: list[LoraAdapter | None] = [None] * config.max_loras
        self._last_used = [0] * config.max_loras
        self._num_plans = 0
        # forward thread: the id of the adapter whose weights each slot holds
        self._written: list[int | None] = [None] * config.max_loras
        self.num_swaps = 0          # adapters copied into a slot
        self.swap_seconds = 0.0     # the time those copies took
        for name, path in config.modules.items():
            self.load(name, path)

    @property
    def slot_bytes(self) -> int:
        """Device (or host) memory the slots take."""
        return sum(p.nbytes for p in self.projections.values())

    # ---- adapters by name (any thread)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter, then serve it under `name`; LoraError when it cannot be
        served or the name is taken."""
        check_lora_name(name)
        if name in self._adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        # once rank 0 lets it go (unloaded and no sequence left on it, or a load the other ranks
        # refused), the others drop their shares with the next step
        weakref.finalize(adapter, self._retired.append, adapter.id)
        if self.peers is not None:      # every rank reads its share before it is served
            self.peers.load_lora(name, path, adapter.id)
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"LoRA adapter {name!r} is already loaded")
            self._adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s: rank %d, %d projections, %.1f MB", name, path,
                 adapter.rank, len(adapter.deltas), adapter.nbytes / 2**20)
        return adapter

    def _read(self, name: str, path: str) -> LoraAdapter:
        return read_adapter(name, path, self.model_config, self.config.max_lora_rank,
                            self._supported, self.shard)

    # ---- a split engine's ranks past 0: the adapters rank 0 holds

    def load_for_rank0(self, name: str, path: str, adapter_id: int) -> None:
        """This rank's share of an adapter rank 0 has loaded, kept under rank 0's id."""
        adapter = self._read(name, path)
        adapter.id = adapter_id
        self._by_id[adapter_id] = adapter

    def take_ids(self, ids: dict[str, int]) -> None:
        """The start-up adapters (--lora-modules, read by every rank) take rank 0's ids."""
        for name, adapter in self._adapters.items():
            adapter.id = ids[name]
            self._by_id[adapter.id] = adapter
        self._adapters.clear()      # (named on rank 0 only: requests name them there)

    def ids(self) -> dict[str, int]:
        return {name: adapter.id for name, adapter in self._adapters.items()}

    def drop(self, ids) -> None:
        """Adapters rank 0 no longer holds."""
        for adapter_id in ids:
            self._by_id.pop(adapter_id, None)

    def for_peers(self, inputs):
        """Rank 0: the step's inputs as the other ranks get them: its LoraBatch with the
        adapters' ids in place of the adapters, and the ids of those gone since the last step."""
        retired = []
        while self._retired:        # (appended to from whichever thread drops an adapter)
            retired.append(self._retired.popleft())
        batch, lora = inputs.batch, inputs.batch.lora
        if lora is not None:
            batch = dataclasses.replace(batch, lora=dataclasses.replace(lora, adapters=None))
        return dataclasses.replace(inputs, batch=batch, lora_retired=retired)

    def unload(self, name: str) -> None:
        """New requests can no longer name it; those running finish with it. KeyError when no
        adapter has that name."""
        with self._lock:
            del self._adapters[name]
        log.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def adapters(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._adapters.values())

    # ---- a step (engine thread, then forward thread)

    def plan(self, seqs, query_start_loc: np.ndarray) -> LoraBatch | None:
        """The step's adapter rows grouped by slot, a slot chosen for each adapter it runs; None
        when every sequence runs the base model. seqs: the step's sequences, whose rows are
        [query_start_loc[i], query_start_loc[i+1])."""
        adapters = [seq.lora for seq in seqs]
        if not any(a is not None for a in adapters):
            return None
        self._num_plans += 1
        in_step: dict[int, int] = {}         # adapter id -> slot
        slot_of_seq = np.full(len(seqs), -1, np.int32)
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                slot = in_step.get(adapter.id)
                if slot is None:
                    slot = in_step[adapter.id] = self._slot_for(adapter, in_step)
                slot_of_seq[i] = slot
        counts = np.diff(query_start_loc)
        slot_of_row = np.repeat(slot_of_seq, counts)
        order = np.argsort(slot_of_row, kind="stable").astype(np.int32)
        order = order[slot_of_row[order] >= 0]
        sorted_slots = slot_of_row[order]
        seg_slots = np.unique(sorted_slots).astype(np.int32)
        seg_offsets = np.searchsorted(sorted_slots, seg_slots).astype(np.int32)
        seg_offsets = np.append(seg_offsets, np.int32(len(order)))
        adapters = [self._assigned[s] for s in seg_slots]
        return LoraBatch(order, seg_offsets, seg_slots, adapters, [a.id for a in adapters])

    def _slot_for(self, adapter: LoraAdapter, in_step: dict[int, int]) -> int:
        """The slot that holds the adapter, else a free one, else the least recently used one
        this step does not use."""
        used = set(in_step.values())
        slot = next((s for s, a in enumerate(self._assigned)
                     if a is not None and a.id == adapter.id), None)
        if slot is None:
            free = [s for s in range(len(self._assigned)) if s not in used]
            if not free:
                raise RuntimeError(f"a step runs more LoRA adapters than --max-loras "
                                   f"({len(self._assigned)}) slots")
            slot = next((s for s in free if self._assigned[s] is None),
                        min(free, key=lambda s: self._last_used[s]))
            self._assigned[slot] = adapter
        self._last_used[slot] = self._num_plans
        return slot

    def begin(self, batch: LoraBatch) -> None:
        """On the forward thread, before the step's forward: the slots the step uses hold its
        adapters (copied in now where they do not), and the projections see its rows."""
        adapters = batch.adapters
        if adapters is None:        # a rank past 0: rank 0's ids
            missing = [i for i in batch.adapter_ids if i not in self._by_id]
            if missing:
                raise RuntimeError(f"rank 0's step runs LoRA adapters {missing} that this "
                                   f"rank has not loaded")
            adapters = [self._by_id[i] for i in batch.adapter_ids]
        for slot, adapter in zip(batch.seg_slots, adapters):
            slot = int(slot)
            if self._written[slot] != adapter.id:
                start = time.perf_counter()
                for (layer, name), projection in self.projections.items():
                    projection.write(slot, adapter.deltas.get((layer, name), []))
                self._written[slot] = adapter.id
                self.backend.synchronize()
                self.num_swaps += 1
                self.swap_seconds += time.perf_counter() - start
        self.use(batch)

    def use(self, batch: LoraBatch | None) -> None:
        """The projections see these rows (a pipeline micro-batch's: LoraBatch.between), whose
        slots hold their adapters already (begin); None: no row runs an adapter."""
        st = self.step
        if batch is None:
            st.rows = None
            return
        st.rows = self.backend.asarray(batch.rows)
        st.seg_offsets, st.seg_slots = batch.seg_offsets, batch.seg_slots

    def end(self) -> None:
        """After the forward: the projections add nothing until the next begin."""
        self.step.rows = None

