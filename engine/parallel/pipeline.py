"""Pipeline parallel: the decoder layers split into stages, one stage per group of ranks (each
group tensor parallel within itself), each rank reading and holding only its stage's layers; the
first stage also holds the embedding, the last the final norm and the LM head.

Ranks are numbered stage by stage: rank r is stage r // tp, tensor-parallel rank r % tp, so rank
0 (which schedules and samples) is on the first stage. Every rank gets each step's inputs from
rank 0 (engine/parallel/steps.py) and runs its stage of the same forward:

- The step's sequences are cut into micro-batches (contiguous runs of sequences of about equal
  token counts). A stage runs them in order, receiving each from the stage before and sending it
  on, so that while stage s computes micro-batch k, stage s + 1 computes micro-batch k - 1: the
  stages idle only while the pipeline fills and drains (a bubble of (stages - 1) / (micro-batches
  + stages - 1) of a step).
- What crosses a stage boundary is the residual stream: the sending stage adds its last layer's
  output into the residual (the add the next layer would make) and sends that one (T, hidden)
  array; the receiving stage's first layer normalizes it as a model's first layer normalizes the
  embeddings (DecoderLayer's `first`), so a stage's layers are built as a model of their own
  (renumbered from 0) by every family's unchanged code.
- A rank sends to the rank of its tensor-parallel index on the next stage (each holds the whole
  stream after its stage's all-reduces). The last stage's rank 0 sends the step's logits (and the
  pooled rows' hidden states, the scored rows' logits) to rank 0 once all micro-batches are done:
  sending them per micro-batch would make rank 0 wait on the last stage while the last stage
  waits on rank 0's next micro-batch.
"""
from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from engine.parallel import stages_gemma4
from engine.parallel.pipeline_profile import StageProfile
from engine.parallel.stage_families import stage_family
from engine.parallel.sharding_vision import SPLIT_VISION, is_tower_tensor
from engine.parallel.stages_vision import text_model_name
from engine.runner.forward_batch import ForwardBatch

# Families split into stages (the stage's layers renumbered from 0, the residual stream handed
# over at the boundary: LlamaForCausalLM's forward, or a family's own that does the same, the
# hybrid models' and Gemma 4's), each checked with pipeline parallel.
STAGED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Glm4ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "StableLmForCausalLM",
    "PhiForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Glm4MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Gemma4ForCausalLM",
)

# (a vision-language checkpoint's language model under model.language_model. or
# language_model.model.: engine/parallel/stages_vision.py)
_LAYER = re.compile(r"^((?:model\.)?(?:language_model\.)?(?:model\.)?layers\.)(\d+)\.(.*)$")
_EMBED = ("model.embed_tokens.weight", "embed_tokens.weight")
_HEAD = ("model.norm.weight", "norm.weight", "lm_head.weight")
# the LayerNorm families' biases (StableLM's model.norm, Phi-2's final_layernorm) and Phi-2's
# biased head: the last stage's too
_HEAD += ("model.norm.bias", "model.final_layernorm.weight", "model.final_layernorm.bias",
          "lm_head.bias")


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, end) layers of each stage: as even as the count allows, the earlier stages one
    more (the last stage also runs the LM head)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline parallel {num_stages}: the model has {num_layers} layers, "
                         f"fewer than the stages")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _family_stages(model_config):
    """A family's own stage cut and whether every stage holds the embedding
    (engine/parallel/stages_<family>.py), or None."""
    return stages_gemma4 if model_config.architecture == stages_gemma4.ARCHITECTURE else None


def model_stage_layers(model_config, num_stages: int) -> list[tuple[int, int]]:
    """stage_layers, or the family's own cut."""
    bounds = stage_layers(model_config.num_hidden_layers, num_stages)
    family = _family_stages(model_config)
    return bounds if family is None else family.stage_layers(model_config, bounds)


def check_model(model_config) -> None:
    """What a stage split cannot carry yet, refused before the load (or at it, for a GGUF)."""
    c = model_config
    if c.architecture not in STAGED_ARCHITECTURES:
        raise ValueError(f"pipeline parallel: {c.architecture} is not yet split into stages "
                         f"(supported: {', '.join(STAGED_ARCHITECTURES)})")
    if c.vision is not None and c.architecture not in SPLIT_VISION:
        raise ValueError(f"pipeline parallel: {c.architecture}'s vision tower is not yet split "
                         f"into stages")


@dataclass(frozen=True)
class PipelineStage:
    """A rank's stage, carried by its model's config (whose layers are then the stage's,
    renumbered from 0)."""
    stage: int
    num_stages: int
    first_layer: int
    end_layer: int
    tp_rank: int
    vocab_size: int                     # the whole vocabulary: the logits rank 0 receives
    hidden_size: int
    tied: bool                          # the LM head is the embedding (the last stage holds it)
    comm: object = dataclasses.field(compare=False, repr=False)   # its rank: the stage
    # every stage holds the input embedding (Gemma 4's per-layer inputs read it on each stage)
    embedding_everywhere: bool = False
    # while CUDA graphs of the stage are captured: the DeferredHandOver the boundary records in
    _deferred: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def of(cls, model_config, stage: int, num_stages: int, tp_rank: int, comm):
        check_model(model_config)
        first, end = model_stage_layers(model_config, num_stages)[stage]
        family = _family_stages(model_config)
        return cls(stage, num_stages, first, end, tp_rank, model_config.vocab_size,
                   model_config.hidden_size, model_config.tie_word_embeddings, comm,
                   embedding_everywhere=family is not None and family.needs_embedding(
                       model_config))

    def tensor_name(self, name: str) -> str | None:
        """The stage's name for a checkpoint tensor (its layers renumbered from 0), or None when
        it is another stage's."""
        if is_tower_tensor(name):       # the first stage's (engine/parallel/stages_vision.py)
            return name if self.first else None
        m = _LAYER.match(name)
        if m:
            i = int(m.group(2))
            if not self.first_layer <= i < self.end_layer:
                return None
            return f"{m.group(1)}{i - self.first_layer}.{m.group(3)}"
        return name if self.holds_end(name) else None

    def take(self, weights: dict) -> dict:
        """The stage's tensors of a checkpoint's, renamed (nothing is read: they are views)."""
        out = {}
        for name, tensor in weights.items():
            local = self.tensor_name(name)
            if local is not None:
                out[local] = tensor
        return out

    def holds_end(self, name: str) -> bool:
        """Whether the stage's model holds an end tensor (the embedding, final norm, LM head)
        the whole model's would. An MTP head's (mtp.*: Qwen3-Next's, Qwen3.5's) goes with the
        last stage, whose final hidden states it reads."""
        name = text_model_name(name)
        if name in _EMBED:
            return self.first or self.embedding_everywhere or (self.last and self.tied)
        if name in _HEAD or name.startswith("mtp."):
            return self.last
        return True

    def local_config(self, c):
        """The stage's model config: its layers, renumbered from 0, with their per-layer
        settings (sliding windows, MoE layers, a family's own: stage_families.py)."""
        a, b = self.first_layer, self.end_layer
        moe = c.moe and dataclasses.replace(c.moe, sparse_layers=c.moe.sparse_layers[a:b])
        la = c.linear_attention and dataclasses.replace(
            c.linear_attention, layer_types=c.linear_attention.layer_types[a:b])
        return dataclasses.replace(c, num_hidden_layers=b - a,
                                   sliding_windows=c.sliding_windows[a:b], moe=moe,
                                   linear_attention=la, family=stage_family(c.family, a, b),
                                   pipeline=self)

    # ---- the boundary

    def receive_stream(self, residual) -> None:
        """The residual stream entering the stage's first layer, from the stage before."""
        if self._deferred:
            self._deferred[-1].receive(residual)
            return
        self.comm.recv(residual, self.stage - 1)

    def send_stream(self, residual) -> None:
        if self._deferred:
            self._deferred[-1].sent = residual
            return
        self.comm.send(residual, self.stage + 1)

    @contextmanager
    def hand_over_deferred(self, zero: bool):
        """Inside: the boundary records the arrays it would receive into and send from, and
        neither receives nor sends (a stage's CUDA graph holds its layers; the replay receives
        before it and sends after it: engine/runner/cuda_graph.py)."""
        hand_over = DeferredHandOver(zero)
        self._deferred.append(hand_over)
        try:
            yield hand_over
        finally:
            self._deferred.pop()


class DeferredHandOver:
    """The residual arrays a stage's forward received into and sent from while its graph was
    captured. Around the graph rather than inside it: the stage's graph then holds only its own
    work, so the stages capture independently (no capture's warm-up waits on a peer's), and the
    replay's receive writes straight into the graph's input rows, its send reads the graph's
    output rows (no copy either way), two launches beside the hundreds in the graph. (vLLM
    hands its intermediate tensors over around its graphs too.)"""

    def __init__(self, zero: bool):
        self.zero = zero            # the eager warm-up computes on zeros, not a stale stream
        self.received = self.sent = None

    def receive(self, residual) -> None:
        self.received = residual
        if self.zero:
            residual.fill(0)


def micro_batches(batch: ForwardBatch, hidden_rows, count: int):
    """The batch cut into at most `count` micro-batches of whole sequences, about equal in
    tokens: a list of (micro-batch, its pooled rows or None, its logits rows' and pooled rows'
    positions in the whole batch's)."""
    B, T = batch.num_seqs, batch.num_tokens
    # a step with image rows runs whole: its rows' M-RoPE cache rows, Gemma 3's image spans are
    # numbered over the whole batch (engine/parallel/stages_vision.py)
    if count <= 1 or B <= 1 or batch.vision is not None:
        return [(batch, hidden_rows, None, None)]
    qsl = np.asarray(batch.query_start_loc)
    # the sequence boundary nearest each even token cut, kept increasing and non-empty
    cuts = [0]
    for k in range(1, count):
        s = int(np.searchsorted(qsl, k * T / count))
        if cuts[-1] < s < B:
            cuts.append(s)
    cuts.append(B)
    logits_at = np.asarray(batch.logits_indices)
    pieces = []
    for s0, s1 in zip(cuts, cuts[1:]):
        t0, t1 = int(qsl[s0]), int(qsl[s1])
        mine = np.nonzero((logits_at >= t0) & (logits_at < t1))[0]
        rows = pooled = None
        if hidden_rows is not None:
            pooled = np.nonzero((hidden_rows >= t0) & (hidden_rows < t1))[0]
            rows = (hidden_rows[pooled] - t0).astype(np.int32)
        piece = ForwardBatch(
            batch.token_ids[t0:t1], batch.positions[t0:t1], batch.slot_mapping[t0:t1],
            (qsl[s0:s1 + 1] - t0).astype(np.int32), batch.seq_lens[s0:s1],
            None if batch.block_tables is None else batch.block_tables[s0:s1],
            (logits_at[mine] - t0).astype(np.int32),
            None if batch.block_table_rows is None else batch.block_table_rows[s0:s1],
            batch.block_table_width)
        if batch.state_plan is not None:        # a hybrid model's state rows: its sequences'
            piece.state_plan = batch.state_plan.of_sequences(s0, s1)
        pieces.append((piece, rows, mine, pooled))
    return pieces


def in_batch_order(xp, parts: list, positions: list, n: int):
    """The micro-batches' rows (each (k, ...)) put back at their positions in the whole batch."""
    if len(parts) == 1 and positions[0] is None:
        return parts[0]
    out = xp.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype)
    for rows, at in zip(parts, positions):
        if len(at):
            out[xp.asarray(at)] = rows
    return out


# Automatic micro-batches (pipeline_micro_batches 0) carry at least this many tokens each. A
# smaller micro-batch is bound by reading its stage's weights, which every micro-batch reads
# again: a decode step of 8 sequences cut in 4 took 268 ms against 101 ms uncut (PP 2 on the
# CPU, bench/pipeline_bubble.py, RESULTS "Pipeline parallel"), while 512-token prefills gain.
MIN_AUTO_MICRO_BATCH_TOKENS = 64


class PipelineRunner:
    """A rank's part of each step: its stage over the step's micro-batches (module docstring).
    forward returns what ModelRunner._forward does on rank 0, (None, None, None) elsewhere.
    num_micro_batches 0 is automatic: twice the stages, fewer where a step has too few tokens to
    cut (MIN_AUTO_MICRO_BATCH_TOKENS); a positive count is taken as it is."""

    def __init__(self, stage: PipelineStage, num_micro_batches: int):
        self.stage = stage
        self.num_micro_batches = num_micro_batches
        # off unless TAPER_PIPELINE_PROFILE is set (engine/parallel/pipeline_profile.py)
        self.profile = StageProfile.from_environment(stage)

    def micro_batch_count(self, num_tokens: int) -> int:
        if self.num_micro_batches:
            return self.num_micro_batches
        return max(1, min(2 * self.stage.num_stages, num_tokens // MIN_AUTO_MICRO_BATCH_TOKENS))

    def plan(self, graphs, inputs) -> tuple | None:
        """Rank 0: the CUDA graph bucket each micro-batch of the step replays (None: that one
        runs eagerly), or None when none does; every rank follows it (StepInputs.graphs)."""
        pieces = micro_batches(inputs.batch, inputs.hidden_rows,
                               self.micro_batch_count(inputs.batch.num_tokens))
        keys = tuple(graphs.choose(piece) for piece, _, _, _ in pieces)
        return keys if any(key is not None for key in keys) else None

    def forward(self, runner, inputs):
        if self.profile is None:
            return self._forward(runner, inputs)
        self.profile.begin()
        out = self._forward(runner, inputs)
        self.profile.end(self.last_micro_batches, inputs.batch.num_tokens)
        return out

    def _forward(self, runner, inputs):
        stage, model, be = self.stage, runner.model, runner.backend
        xp = be.xp
        batch, hidden_rows = inputs.batch, inputs.hidden_rows
        pieces = micro_batches(batch, hidden_rows, self.micro_batch_count(batch.num_tokens))
        self.last_micro_batches = len(pieces)
        plan = inputs.graphs or (None,) * len(pieces)
        if len(plan) != len(pieces):
            raise RuntimeError(f"rank 0 planned graphs for {len(plan)} micro-batches, this "
                               f"rank cut the step into {len(pieces)}")
        if inputs.graphs is not None and runner.graph_runner is None:
            raise RuntimeError("rank 0 replays CUDA graphs for this step, but this rank "
                               "captured none")
        logits, hidden = [], []
        start = 0       # the micro-batch's first row in the step
        for (piece, rows, _, _), key in zip(pieces, plan):
            if batch.lora is not None:      # its LoRA rows (the slots hold the step's adapters)
                piece.lora = batch.lora.between(start, start + piece.num_tokens)
                runner.lora.use(piece.lora)
            start += piece.num_tokens
            if key is not None:     # this stage's graph, the stream handed over around it
                out = runner.graph_runner.run(piece, key)
                if out is not None:     # a view of the graphs' static logits: the next
                    out = out.copy()    # micro-batch's replay rewrites them
                if stage.last:
                    logits.append(out)
                continue
            out = model.forward(runner.to_device(piece), runner.kv_caches,
                                hidden_indices=None if rows is None else be.asarray(rows))
            if stage.last:
                logits.append(out if rows is None else out[0])
                if rows is not None:
                    hidden.append(out[1])
        stage.comm.flush()
        n_logits = len(batch.logits_indices)
        n_hidden = 0 if hidden_rows is None else len(hidden_rows)
        n_scores = 0 if inputs.score_rows is None else len(inputs.score_rows)
        if stage.last:
            logits = in_batch_order(xp, logits, [p[2] for p in pieces], n_logits)
            scores = None
            if hidden_rows is not None:
                hidden = in_batch_order(xp, hidden, [p[3] for p in pieces], n_hidden)
                if inputs.score_rows is not None:
                    scores = model.logits(xp.ascontiguousarray(
                        hidden[be.asarray(inputs.score_rows)]))
            if stage.first and stage.tp_rank == 0:      # a pipeline of one stage (a check on
                return logits, hidden if hidden_rows is not None else None, scores  # one GPU)
            if stage.tp_rank == 0:
                for x in (logits, hidden if hidden_rows is not None else None, scores):
                    if x is not None and len(x):
                        stage.comm.send(x, 0)
                stage.comm.flush()
            return None, None, None
        if not (stage.first and stage.tp_rank == 0):
            return None, None, None
        last = stage.num_stages - 1
        logits = xp.empty((n_logits, stage.vocab_size), dtype=np.float32)
        hidden = scores = None
        if n_logits:
            stage.comm.recv(logits, last)
        if hidden_rows is not None:
            hidden = xp.empty((n_hidden, stage.hidden_size), dtype=be.act_dtype)
            if n_hidden:
                stage.comm.recv(hidden, last)
        if inputs.score_rows is not None:
            scores = xp.empty((n_scores, stage.vocab_size), dtype=np.float32)
            if n_scores:
                stage.comm.recv(scores, last)
        return logits, hidden, scores
