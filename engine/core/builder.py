"""Everything an engine is built from, in start-up order: the backend, the model (loaded, or given
by the caller), the tokenizer and pooling, the KV pool's size and the maximum model length, the
concurrency (max_num_seqs), the model runner and, on CUDA, the captured decode graphs."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.hybrid_state import HybridBlockPool, StatePoolSize
from engine.core.max_num_seqs import MAX_NUM_SEQS_CAP, default_max_num_seqs
from engine.loader.hub import resolve_gguf, resolve_model
from engine.loader.model_loader import load_eagle3_head, load_gguf_model, load_model
from engine.loader.safetensors import mem_available_bytes
from engine.lora.manager import LoraManager
from engine.lora.shards import AdapterShard
from engine.models.deepseek_mtp import DeepseekMtpHead
from engine.models.model_config import ModelConfig
from engine.models.qwen3_next_mtp import Qwen3NextMtpHead
from engine.parallel import launch
from engine.parallel import layers as tensor_parallel_layers
from engine.parallel.pipeline import PipelineRunner, model_stage_layers
from engine.parallel.steps import StepSender
from engine.runner import cuda_memory
from engine.runner.backends import make_backend
from engine.runner.cuda_graph import CudaGraphRunner, estimate_graph_memory_bytes
from engine.runner.model_runner import ModelRunner
from engine.sampling.pooling import PoolingConfig, default_pooling_config, read_pooling_config
from engine.spec.draft_model import DraftModel
from engine.spec.eagle3 import Eagle3Proposer
from engine.spec.mtp import MtpProposer
from engine.text.tokenizer import Tokenizer

log = logging.getLogger("taper.engine")

@dataclass(slots=True)
class EngineParts:
    config: EngineConfig          # the caller's, with max_num_seqs resolved (a copy)
    backend: object
    model: object
    model_config: ModelConfig
    model_dir: str | None
    tokenizer: Tokenizer | None
    pooling: PoolingConfig        # how /v1/embeddings pools
    eos_token_ids: set[int]
    block_pool: BlockPool
    max_model_len: int
    runner: ModelRunner
    # speculative decoding's draft model, EAGLE-3 or MTP head, its pools beside the target's
    draft: DraftModel | None = None
    lora: LoraManager | None = None   # LoRA adapters (--enable-lora)


def build(config: EngineConfig, loaded=None, group=None) -> EngineParts:
    """loaded: (backend, model, model_config) built by the caller (benchmarks that generate
    weights on the device) instead of loading config.model; there is no tokenizer then. A fourth
    item, (draft model, its config), is the draft of method draft_model, instead of loading
    speculative_config.model (bench/gpu_spec.py makes both on the device).
    Tensor parallel (engine/parallel/launch.py): rank 0 starts the other ranks here, each of
    which builds its share of the engine through this function too, `group` its MpiGroup;
    pipeline parallel (engine/parallel/pipeline.py) the same way, each rank its stage."""
    tensor_parallel = pipeline = None
    if config.world_size > 1:
        if loaded is not None:
            raise ValueError(f"{launch.kind(config)}: a model built by the caller cannot be "
                             f"split")
        group = group or launch.start_group(config)
    given_draft = None
    if loaded is not None:
        backend, model, model_config, *given_draft = loaded
        given_draft = given_draft[0] if given_draft else None
        model_dir, tokenizer, pooling_config = None, None, None
    elif group is not None:
        with launch.all_ranks(group, "loading the model"):
            backend = make_backend(config, group.rank)
            tensor_parallel, pipeline = launch.communicators(group, backend, config)
            model, model_config, model_dir, tokenizer, pooling_config = _load(
                config, backend, tensor_parallel, pipeline)
        if group.rank != 0:
            tokenizer = None
    else:
        backend = make_backend(config)
        model, model_config, model_dir, tokenizer, pooling_config = _load(config, backend)
    if config.tokenizer:        # an explicit tokenizer wins (a GGUF's own may be missing)
        tokenizer = Tokenizer.try_from_pretrained(config.tokenizer)
    eos_token_ids = set(model_config.eos_token_ids)
    if tokenizer is not None:
        eos_token_ids |= tokenizer.eos_token_ids

    # (model, config) or None. Under tensor or pipeline parallel the draft is small: rank 0
    # holds it whole beside the scheduler (its KV pool too) and proposes; every rank verifies.
    if group is None:
        draft = _load_draft(config, backend, model_config, tokenizer, given_draft)
    else:
        with launch.all_ranks(group, "loading the draft model"):
            draft = (_load_draft(config, backend, model_config, tokenizer)
                     if group.rank == 0 else None)
    if group is None:
        head = _load_eagle3(config, backend, model, model_config)
    else:
        with launch.all_ranks(group, "loading the EAGLE-3 head"):
            head = _load_eagle3(config, backend, model, model_config, group)
    # the adapter slots before the KV pool is sized: on a GPU they take device memory
    lora = None
    if config.lora is not None:
        lora = _lora_manager(config, model, model_config, backend, group)
        log.info("LoRA: %d slots of rank %d in %s (%.0f MiB), %d adapters loaded",
                 config.lora.max_loras, config.lora.max_lora_rank, lora.dtype.name,
                 lora.slot_bytes / 2**20, len(lora.adapters()))
    mtp = _load_mtp(config, model, model_config)
    kv_dtype = backend.kv_cache_dtype(config.kv_cache_dtype)
    if config.kv_cache_dtype == "fp8":
        log.info("FP8 (e4m3) KV cache with %s", "the checkpoint's k/v scales"
                 if getattr(model, "kv_scales_from_checkpoint", False)
                 else "scale 1.0 (the checkpoint has no k_scale/v_scale)")
    on_gpu = config.backend == "cuda"
    if on_gpu:
        # CuPy's current device and stream are per thread: this one profiles and captures.
        backend.bind_thread()
        cuda_memory.profile_forward(model, backend, config.max_num_batched_tokens,
                                    config.max_num_seqs or MAX_NUM_SEQS_CAP, config.block_size)
    states = []     # a hybrid model's StatePoolSize, carved out of the KV budget
    if model_config.linear_attention is not None:
        config = _without_graphs(config, "a hybrid linear-attention model (its state rows are "
                                 "planned per step on the host)")
    if model_config.moe is not None and not backend.fused_moe:
        config = _without_graphs(config, "a MoE model on the moe=simple path (each step's "
                                 "expert counts are read on the host); --kernels moe=fused "
                                 "captures them")
    # KV heads per block: the rank's under tensor parallel (its model's config)
    num_blocks = config.num_kv_blocks or _num_kv_blocks(
        config, backend, getattr(model, "config", model_config), kv_dtype,
        draft[1] if draft else None,
        Eagle3Proposer.bytes_per_block(head.config, config.block_size, kv_dtype,
                                       backend.act_dtype) if head else
        MtpProposer.bytes_per_block(mtp, config.block_size, kv_dtype,
                                    backend.act_dtype) if mtp else 0,
        # a hybrid model's state rows: the rank's heads' under tensor parallel
        reserve=lambda budget, what: _reserve_states(
            states, config, getattr(model, "config", model_config), budget, what),
        capture_width=(len(head.aux_layers) * model_config.hidden_size if head else
                       model_config.hidden_size if mtp else 0))
    if model_config.linear_attention is not None and not states:   # explicit num_kv_blocks
        states.append(StatePoolSize.for_model(config, getattr(model, "config", model_config),
                                              None))
    if group is not None:       # every rank's pool has the smallest one's blocks
        num_blocks = min(group.allgather(num_blocks))
        if states:              # and state rows (rank 0's plan indexes them on every rank)
            states[0] = dataclasses.replace(
                states[0], num_slots=min(group.allgather(states[0].num_slots)),
                num_snapshots=min(group.allgather(states[0].num_snapshots)),
                num_verify_rows=min(group.allgather(states[0].num_verify_rows)))
    max_cached = (None if config.prefix_cache_max_tokens is None
                  else config.prefix_cache_max_tokens // config.block_size)
    if states:
        block_pool = HybridBlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                                     max_cached, states[0].num_slots, states[0].num_snapshots,
                                     states[0].num_verify_rows)
    else:
        block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                               max_cached_blocks=max_cached)
    max_model_len = _max_model_len(config, model_config, num_blocks * config.block_size)
    if draft is not None and draft[1].max_model_len < max_model_len:
        log.warning("max model length limited to %d tokens by the draft model's context",
                    draft[1].max_model_len)
        max_model_len = draft[1].max_model_len
    if config.max_num_seqs is None:
        max_num_seqs, why = default_max_num_seqs(
            num_blocks * config.block_size, max_model_len, config.max_num_batched_tokens)
        if states and states[0].num_slots < max_num_seqs:
            max_num_seqs, why = states[0].num_slots, "the hybrid model's state slots"
        log.info("max_num_seqs %d: %s; --max-num-seqs sets it", max_num_seqs, why)
        config = dataclasses.replace(config, max_num_seqs=max_num_seqs)
    runner = ModelRunner(model, model_config, backend, config.block_size, num_blocks,
                         config.kv_cache_dtype, state_pool=block_pool if states else None)
    runner.lora = lora
    if group is not None:
        pids = group.allgather(os.getpid())
        sender = (StepSender(group, pids[1:], kind=launch.kind(config),
                             watch=getattr(group, "watch", None)) if group.rank == 0 else None)
        runner.join_tensor_parallel(sender)
        if pipeline is not None:
            runner.pipeline = PipelineRunner(model.config.pipeline, config.pipeline_micro_batches)
        if lora is not None:        # rank 0's adapter loads reach every rank
            lora.peers = sender
        if sender is not None:
            launch.stop_at_exit(sender)
            log.info("%s: rank 0 schedules and samples, every rank holds its share of the "
                     "weights and %d KV blocks", launch.sizes(config), num_blocks)
            if pipeline is not None:
                log.info("pipeline parallel: stages of layers %s, %d micro-batches a step",
                         model_stage_layers(model_config, config.pipeline_parallel_size),
                         runner.pipeline.num_micro_batches)
    log.info("KV cache: %d blocks of %d tokens; max model length %d", num_blocks,
             config.block_size, max_model_len)
    if states:
        log.info("recurrent state: %s; KV blocks for %d full-attention layers of %d",
                 states[0].describe(), model_config.num_kv_layers, model_config.num_hidden_layers)
    draft_model = None
    if draft is not None:
        draft_model = DraftModel(draft[0], draft[1], backend, num_blocks, config.block_size,
                                 config.kv_cache_dtype, model_config.vocab_size)
        log.info("speculative decoding: draft model %s (%d layers), %d tokens per step, its "
                 "own KV pool of %d blocks", config.speculative_config.model,
                 draft[1].num_hidden_layers, config.speculative_config.num_speculative_tokens,
                 num_blocks)
    elif head is not None:
        draft_model = Eagle3Proposer(head, backend, num_blocks, config.block_size,
                                     config.kv_cache_dtype, model_config.vocab_size)
        runner.aux_capture = draft_model.capture
        log.info("speculative decoding: EAGLE-3 head %s (draft vocabulary %d, the target's "
                 "layers %s), %d tokens per step, its K/V and features in %d blocks",
                 config.speculative_config.model, head.config.draft_vocab_size,
                 list(head.aux_layers), config.speculative_config.num_speculative_tokens,
                 num_blocks)
    elif mtp is not None:
        draft_model = MtpProposer(mtp, backend, num_blocks, config.block_size,
                                  config.kv_cache_dtype, model_config.vocab_size)
        runner.aux_capture = draft_model.capture
        # tensor parallel: every rank holds its shard of the head; rank 0 sends the drafting
        # forwards (engine/parallel/draft_steps.py), the others run them (worker.py)
        draft_model.peers = runner.peers
        log.info("speculative decoding: the checkpoint's MTP head (%s), %d tokens per step, its "
                 "cache and the target's hidden states in %d blocks", mtp.describe(),
                 config.speculative_config.num_speculative_tokens, num_blocks)
    elif config.speculative_config is not None:
        log.info("speculative decoding: %s", config.speculative_config)
    if on_gpu:
        cuda_memory.log_pool(num_blocks, config.block_size,
                             ModelRunner.kv_bytes_per_block(model_config, config.block_size,
                                                            kv_dtype),
                             max_model_len, config.max_num_seqs)
        backend.max_context = max_model_len
        if (config.cuda_graph and runner.aux_capture is not None
                and backend.kernels.graphs_verify != "on"):
            log.info("CUDA graphs: not captured (an EAGLE-3 or MTP head reads every step's "
                     "hidden states; --kernels graphs_verify=on captures graphs that hand them "
                     "over)")
        elif config.cuda_graph and group is not None and not graphs_on_ranks(backend):
            log.info("CUDA graphs: not captured on %s ranks (--kernels graphs_parallel=on "
                     "captures them, the collectives inside)", launch.kind(config))
        elif config.cuda_graph:
            if group is None:
                capture_cuda_graphs(config, model, backend, runner, max_model_len)
            else:
                with launch.all_ranks(group, "capturing CUDA graphs"):
                    capture_cuda_graphs(config, model, backend, runner, max_model_len)
                with launch.all_ranks(group, "comparing the CUDA graphs' buckets"):
                    launch.check_same_buckets(group, runner.graph_runner)
    return EngineParts(config, backend, model, model_config, model_dir, tokenizer,
                       pooling_config or default_pooling_config(model_dir), eos_token_ids,
                       block_pool, max_model_len, runner, draft_model, lora)


def _lora_manager(config: EngineConfig, model, model_config: ModelConfig, backend, group):
    """The LoRA slots and start-up adapters; on a split engine every rank's, each holding its
    share (engine/lora/shards.py), the adapters under rank 0's ids."""
    if group is None:
        return LoraManager(config.lora, model, model_config, backend, config.dtype)
    lora = None
    with launch.all_ranks(group, "loading the LoRA adapters"):
        shard = AdapterShard.of(model.config, model_config, config.enable_expert_parallel)
        lora = LoraManager(config.lora, model, model_config, backend, config.dtype, shard)
    ids = group.allgather(lora.ids())[0]
    if group.rank != 0:
        lora.take_ids(ids)
    return lora


def _load_draft(config: EngineConfig, backend, target_config: ModelConfig, tokenizer,
                given=None):
    """(model, model_config) of the speculative config's draft model (or `given`, built by the
    caller), checked against the target: the same tokenizer (token ids mean the same text), else
    a ValueError naming it."""
    spec = config.speculative_config
    if given is not None and (spec is None or spec.method != "draft_model"):
        raise ValueError("a draft model was given, but the speculative config's method is not "
                         "draft_model")
    if spec is None or spec.method != "draft_model":
        return None
    if given is not None:
        model, draft_config = given
        draft_tokenizer = None
    elif spec.model.endswith(".gguf"):      # a GGUF file (a quantized copy of the target, say)
        model, draft_config, draft_tokenizer = load_gguf_model(
            spec.model, backend, dtype=config.dtype,
            yarn_scaling_factor=config.yarn_scaling_factor)
    else:
        draft_dir = resolve_model(spec.model)
        model, draft_config = load_model(draft_dir, backend, dtype=config.dtype,
                                         yarn_scaling_factor=config.yarn_scaling_factor)
        draft_tokenizer = Tokenizer.try_from_pretrained(draft_dir)
    if not draft_config.has_lm_head:
        raise ValueError(f"draft model {spec.model}: it has no lm_head, it cannot propose tokens")
    if draft_config.linear_attention is not None:
        raise ValueError(f"draft model {spec.model}: a hybrid linear-attention draft "
                         f"({draft_config.architecture}) is not supported (its recurrent state "
                         f"would need state slots and rollback of its own); use a draft with "
                         f"full attention only")
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.hf.get_vocab() != draft_tokenizer.hf.get_vocab():
            raise ValueError(f"draft model {spec.model}: its tokenizer differs from the target's "
                             f"(speculative decoding needs the same token ids)")
    elif draft_config.vocab_size != target_config.vocab_size:
        # no tokenizers to compare: the vocabularies must at least have one size
        raise ValueError(f"draft model {spec.model}: vocabulary of {draft_config.vocab_size} "
                         f"ids, the target's has {target_config.vocab_size}, and there is no "
                         f"tokenizer to show they agree")
    return model, draft_config


def _load_eagle3(config: EngineConfig, backend, model, model_config: ModelConfig, group=None):
    """The speculative config's EAGLE-3 head, or None. Under tensor parallel the head (one small
    layer) runs whole on rank 0 beside the scheduler, as a draft model does, reading the target's
    hidden states there (whole on every rank after the all-reduces); one without an embedding of
    its own reads the target's, gathered whole from the ranks' vocabulary shares."""
    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return None
    if (model_config.linear_attention is not None
            or "capture" not in inspect.signature(model.forward).parameters):
        raise ValueError(f"EAGLE-3: the target's graph ({model_config.architecture}) cannot "
                         f"hand its hidden states to a head")
    if group is None:
        return load_eagle3_head(resolve_model(spec.model), backend, model, model_config,
                                dtype=config.dtype)
    embed = tensor_parallel_layers.whole_vocab_rows(model.config, model.embed_tokens)
    if group.rank != 0:
        return None
    return load_eagle3_head(resolve_model(spec.model), backend, model, model_config,
                            dtype=config.dtype, target_embed=embed)


def _load_mtp(config: EngineConfig, model, model_config: ModelConfig):
    """The speculative config's MTP head, taken from the target's checkpoint, or None. The
    target's MTP tensors are dropped when nothing drafts with them."""
    spec = config.speculative_config
    kept = getattr(model, "mtp_weights", None)
    if spec is None or spec.method != "mtp":
        if kept:
            log.info("dropping the checkpoint's %d multi-token-prediction tensors (speculative "
                     "decoding with method mtp would use them)", len(kept))
            kept.clear()
        return None
    if kept is None:
        raise ValueError(f"MTP: the target's architecture ({model_config.architecture}) has no "
                         f"multi-token-prediction head Taper can run; method mtp supports "
                         f"DeepSeek-V3-style MLA checkpoints (DeepseekV3ForCausalLM, "
                         f"DeepseekV2ForCausalLM, Glm4MoeLiteForCausalLM) and the hybrid "
                         f"Qwen3-Next and Qwen3.5 families")
    if model_config.linear_attention is not None:
        if not kept:
            raise ValueError("MTP: the checkpoint has no multi-token-prediction head (no mtp.* "
                             "tensors); use another speculative method")
        return Qwen3NextMtpHead(model)
    if not kept:
        raise ValueError(f"MTP: the checkpoint has no multi-token-prediction layers (no "
                         f"model.layers.{model_config.num_hidden_layers}.* tensors; its config "
                         f"says num_nextn_predict_layers {model_config.mla.num_mtp_layers}); "
                         f"use another speculative method")
    return DeepseekMtpHead(model)


def _load(config: EngineConfig, backend, tensor_parallel=None, pipeline=None):
    """(model, model_config, model_dir, tokenizer, pooling config) of config.model;
    tensor_parallel: (rank, size, communicator), the rank's share of it; pipeline: (stage,
    stages, tensor-parallel rank, communicator), the rank's stage of it."""
    load_args = dict(dtype=config.dtype, yarn_scaling_factor=config.yarn_scaling_factor,
                     isq=config.isq, tensor_parallel=tensor_parallel, pipeline=pipeline,
                     expert_parallel=config.enable_expert_parallel)
    if config.mmproj and not config.weight_file:
        raise ValueError("--mmproj goes with a GGUF --weight-file (the text model it projects "
                         "into)")
    if config.weight_file:
        path = resolve_gguf(config.model, config.weight_file)
        model, model_config, tokenizer = load_gguf_model(path, backend, mmproj=config.mmproj,
                                                         **load_args)
        return model, model_config, os.path.dirname(os.path.abspath(path)), tokenizer, None
    model_dir = resolve_model(config.model)
    pooling_config = read_pooling_config(model_dir)
    # old sentence-transformers saves keep the transformer in a subfolder
    transformer_dir = os.path.join(model_dir, pooling_config.transformer_path
                                   if pooling_config else "")
    model, model_config = load_model(transformer_dir, backend, **load_args)
    return (model, model_config, model_dir, Tokenizer.try_from_pretrained(transformer_dir),
            pooling_config)


def graphs_on_ranks(backend) -> bool:
    """Whether tensor- and pipeline-parallel ranks capture CUDA graphs (--kernels
    graphs_parallel=on; off until a GPU window has run tests/gpu's checks of it)."""
    return backend.kernels.graphs_parallel == "on"


def graph_query_lens(config: EngineConfig, backend) -> tuple[int, ...]:
    """The tokens per sequence CUDA graphs are captured for: 1 (decode), and k + 1 for the
    verify steps of speculation under --kernels graphs_verify=on (an EAGLE-3 or MTP head's
    hidden states come out of the graphs with the logits)."""
    spec = config.speculative_config
    if spec is None or backend.kernels.graphs_verify != "on":
        return (1,)
    return (1, spec.num_speculative_tokens + 1)


def capture_cuda_graphs(config: EngineConfig, model, backend, runner: ModelRunner,
                        max_model_len: int):
    """Decode graphs; with --kernels graphs_verify=on verify-step graphs too, and with
    graphs_lora=on graphs that read the rows' LoRA adapter slots (steps with adapter rows
    otherwise run eagerly)."""
    lora_step = (runner.lora.step if runner.lora is not None
                 and backend.kernels.graphs_lora == "on" else None)
    # a hybrid model's state rows and a vision model's images are planned per step, which a
    # verify graph does not take: their verify steps run eagerly (the model's config, not the
    # runner's vision: tensor parallel ranks past 0 hold no tower, and capture what rank 0 does)
    query_lens = (graph_query_lens(config, backend) if runner.state_pool is None
                  and getattr(model.config, "vision", None) is None else (1,))
    graphs = CudaGraphRunner(model, backend, runner.kv_caches, config.max_num_seqs,
                             -(-max_model_len // config.block_size), runner.device_block_tables,
                             query_lens, lora_step, runner.aux_capture, config.block_size)
    start = time.monotonic()
    graphs.capture()
    runner.graph_runner = graphs
    log.info("CUDA graphs: captured for batch sizes %s x tokens per sequence %s%s in %.1f s, "
             "%.0f MiB", graphs.sizes, graphs.query_lens,
             " over LoRA adapter slots" if lora_step is not None else "",
             time.monotonic() - start, graphs.graph_memory_bytes / 2**20)


def _without_graphs(config: EngineConfig, why: str) -> EngineConfig:
    """The config without CUDA graphs, for a model whose steps are planned on the host (a
    graph would replay the plan of the step it captured)."""
    if config.backend == "cuda" and config.cuda_graph:
        log.info("CUDA graphs: off for %s", why)
        config = dataclasses.replace(config, cuda_graph=False)
    return config


def _reserve_states(states: list, config: EngineConfig, model_config: ModelConfig, budget: int,
                    what: str) -> int:
    """Bytes a hybrid model's state rows take from the KV budget (0 for other models); the
    StatePoolSize goes into `states`."""
    size = StatePoolSize.for_model(config, model_config, budget, what)
    if size is None:
        return 0
    states.append(size)
    return size.total_bytes


def _num_kv_blocks(config: EngineConfig, backend, model_config: ModelConfig, kv_dtype,
                   draft_config: ModelConfig | None = None, extra_per_block: int = 0,
                   reserve=None, capture_width: int = 0) -> int:
    """Blocks in the KV budget: --mem MB, else --kv-fraction of the memory left after loading
    the weights (on a GPU: after activations and CUDA graphs too), else 1 GiB on the CPU. A
    draft model's pool has as many blocks as the target's: a block costs both (an EAGLE-3
    head's pools: extra_per_block)."""
    per_block = (ModelRunner.kv_bytes_per_block(model_config, config.block_size, kv_dtype)
                 + extra_per_block)
    if draft_config is not None:
        per_block += ModelRunner.kv_bytes_per_block(draft_config, config.block_size, kv_dtype)
    if config.backend == "cuda":
        backend.xp.get_default_memory_pool().free_all_blocks()
        free, _ = backend.memory_info()
        reserved = 0
        if config.cuda_graph and (config.world_size == 1 or graphs_on_ranks(backend)):
            reserved = estimate_graph_memory_bytes(   # max_num_seqs unknown yet: the cap
                config.max_num_seqs or MAX_NUM_SEQS_CAP,
                -(-model_config.max_model_len // config.block_size), model_config,
                graph_query_lens(config, backend), config.lora is not None, capture_width)
        budget, what = cuda_memory.kv_budget_bytes(free, reserved, config.kv_fraction,
                                                   config.kv_cache_memory_mb)
    elif config.kv_cache_memory_mb is not None:
        budget, what = config.kv_cache_memory_mb * 2**20, f"{config.kv_cache_memory_mb} MB"
    elif config.kv_fraction is not None:
        available = mem_available_bytes()
        if available is None:
            raise ValueError("--kv-fraction needs to know the free memory, which this system "
                             "does not report; give --mem in MB instead")
        budget = int(available * config.kv_fraction)
        what = f"{config.kv_fraction:g} of {available / 2**30:.1f} GiB free"
    else:
        budget, what = 1024 * 2**20, "the default 1024 MB"
    if reserve is not None:         # a hybrid model's state rows come out of the budget first
        budget -= reserve(budget, what)
    # (per_block 0: a pipeline stage without KV-cache layers, a hybrid model's linear ones; the
    # other stages' blocks bound the pool, every rank taking the fewest)
    num_blocks = budget // max(per_block, 1)
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({what}) holds no block")
    return num_blocks


def _max_model_len(config: EngineConfig, model_config: ModelConfig, pool_tokens: int) -> int:
    model_max = model_config.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > model_max:
            raise ValueError(
                f"--max-model-len {config.max_model_len} is larger than the model's "
                f"context ({model_max} positions, RoPE scaling included)")
        if config.max_model_len > pool_tokens:
            raise ValueError(
                f"--max-model-len {config.max_model_len} is larger than the KV cache can "
                f"ever hold ({pool_tokens} tokens); raise the KV cache memory or lower it")
        return config.max_model_len
    if model_max > pool_tokens:
        log.warning("max model length limited to %d tokens by the KV cache (model allows %d)",
                    pool_tokens, model_max)
    return min(model_max, pool_tokens)
