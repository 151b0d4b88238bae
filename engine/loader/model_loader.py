"""The one-call loaders: a checkpoint (safetensors directory or GGUF file) read, its quantized
formats converted, --isq applied, and the model graph built on a backend."""
from __future__ import annotations

import json
import logging
import os

from engine.loader.gguf import open_reader, read_gguf, read_metadata
from engine.loader.gguf_deepseek import read_deferred
from engine.loader.gguf_mmproj import join_vision, read_mmproj
from engine.loader.isq import quantize_weights
from engine.loader.quant_formats import convert_quantized
from engine.loader.safetensors import add_model_prefix, load_safetensors
from engine.models.llama_eagle3 import Eagle3Config, Eagle3Head, normalize_names
from engine.models.model_config import ModelConfig
from engine.models.registry import get_model_class
from engine.parallel.pipeline import PipelineStage
from engine.parallel.sharding import ShardPlan, check_isq_split

log = logging.getLogger("taper.parallel")


def load_model(model_dir: str, backend, dtype: str = "auto",
               yarn_scaling_factor: float | None = None, progress: bool = True,
               isq: str | None = None, tensor_parallel=None, pipeline=None,
               expert_parallel: bool = False):
    """(model, model_config) for a local checkpoint directory; `isq` quantizes its projection
    matrices at load (engine/loader/isq.py). tensor_parallel: (rank, size, communicator): the
    rank's share of the model is read and built (engine/parallel/sharding.py); the config
    returned is the whole model's. pipeline: (stage, stages, tensor-parallel rank,
    communicator): only the stage's layers are read and built (engine/parallel/pipeline.py).
    expert_parallel: the tensor-parallel ranks hold whole experts, E / size each."""
    model_config = ModelConfig.from_pretrained(model_dir, yarn_scaling_factor=yarn_scaling_factor)
    model_class = get_model_class(model_config.architecture)
    plan = _plan(model_config, tensor_parallel, expert_parallel)
    stage = _stage(model_config, pipeline)
    weights = load_safetensors(model_dir, dtype=dtype, progress=progress,
                               quantized=bool(model_config.quantization_config),
                               shard=_shard_hook(plan, stage))
    # (a vision-language model's classes read their checkpoints' own layouts, which may name no
    # tensor model.*: the hub's Gemma 3 files, Mistral 3's language_model.model.*; and
    # language_model.: Llama 4's multimodal layout, renamed by its family's file)
    if model_config.vision is None and not any(name.startswith(("model.", "language_model."))
                                               for name in weights):
        # The headless layout (LlamaModel.save_pretrained, and some embedding models that keep a
        # *ForCausalLM config over it): without an lm_head, an untied one cannot generate.
        weights = add_model_prefix(weights)
        if ("lm_head.weight" not in weights and not model_config.tie_word_embeddings
                and (stage is None or stage.last)):
            model_config.has_lm_head = False
    if stage is not None:
        weights = stage.take(weights)
    if model_config.quantization_config:
        convert_quantized(weights, model_config.quantization_config)
    if isq:
        if plan is not None:
            check_isq_split(plan, weights, isq)
        quantize_weights(weights, isq, progress=progress)
    model = model_class(_local(model_config, plan, tensor_parallel, stage), weights, backend)
    return model, model_config


def load_gguf_model(path: str, backend, dtype: str = "auto",
                    yarn_scaling_factor: float | None = None, progress: bool = True,
                    isq: str | None = None, tensor_parallel=None, pipeline=None,
                    mmproj: str | None = None, expert_parallel: bool = False):
    """(model, model_config, tokenizer or None) for a GGUF file (its first shard if split);
    tensor_parallel, pipeline and expert_parallel as load_model's; mmproj: llama.cpp's vision
    projector file, whose tower joins the text model (engine/loader/gguf_mmproj.py)."""
    ckpt = read_gguf(path, dtype=dtype, progress=progress, deferred=True)
    config, weights = ckpt.config, ckpt.weights
    if mmproj is not None:
        vision, vision_weights = read_mmproj(mmproj, dtype)
        config = join_vision(config, read_metadata(open_reader(path)), vision, path)
        weights.update(vision_weights)
    model_config = ModelConfig.from_dict(config, yarn_scaling_factor=yarn_scaling_factor)
    plan = _plan(model_config, tensor_parallel, expert_parallel)
    stage = _stage(model_config, pipeline)
    hook = _shard_hook(plan, stage)
    if hook is not None:        # the tensors are memory-mapped: cut before they are read
        shapes = {n: w.shape for n, w in weights.items()}
        weights = {n: s for n, w in weights.items() if (s := hook(n, w, shapes)) is not None}
    if stage is not None:
        weights = stage.take(weights)
    read_deferred(weights)      # (deepseek2's kv_b_proj: only the rank's heads and layers)
    if isq:
        if plan is not None:
            check_isq_split(plan, weights, isq)
        quantize_weights(weights, isq, progress=progress)
    model = get_model_class(model_config.architecture)(
        _local(model_config, plan, tensor_parallel, stage), weights, backend)
    return model, model_config, ckpt.tokenizer


def _plan(model_config: ModelConfig, tensor_parallel, expert_parallel: bool = False
          ) -> ShardPlan | None:
    if tensor_parallel is None:        # (a group of one is still split: the GPU suite's check)
        return None
    rank, size, _ = tensor_parallel
    plan = ShardPlan(model_config, rank, size, expert_parallel)
    if plan.experts is not None:
        log.info("%s; this rank (%d) reads only its own", plan.expert_map(), rank)
    return plan


def _stage(model_config: ModelConfig, pipeline) -> PipelineStage | None:
    if pipeline is None:
        return None
    stage, num_stages, tp_rank, comm = pipeline
    return PipelineStage.of(model_config, stage, num_stages, tp_rank, comm)


def _shard_hook(plan: ShardPlan | None, stage: PipelineStage | None):
    """load_safetensors' shard: the rank's cut of its stage's tensors, None for the others."""
    if stage is None:
        return plan and plan.shard

    def hook(name, tensor, shapes):
        if stage.tensor_name(name) is None:
            return None
        return tensor if plan is None else plan.shard(name, tensor, shapes)
    return hook


def _local(model_config: ModelConfig, plan: ShardPlan | None, tensor_parallel,
           stage: PipelineStage | None = None) -> ModelConfig:
    """The config the rank's model is built with."""
    local = model_config if plan is None else plan.local_config(tensor_parallel[2])
    return local if stage is None else stage.local_config(local)


TARGETS = object()      # load_eagle3_head's target_embed: the target model's own table


def load_eagle3_head(head_dir: str, backend, target, target_config: ModelConfig,
                     dtype: str = "auto", progress: bool = True,
                     target_embed=TARGETS) -> Eagle3Head:
    """The EAGLE-3 head in head_dir, drafting for `target` (its model and config): its config
    and tensors checked against the target's, its embedding the target's when it has none
    (target_embed: that embedding whole where the target holds a tensor-parallel share of it,
    or None where it is not available whole; by default the target's own)."""
    path = os.path.join(head_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {head_dir}")
    try:
        with open(path) as f:
            config = Eagle3Config.from_dict(json.load(f))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    where = f"EAGLE-3 head {head_dir}"
    if config.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"{where}: its target_hidden_size is {config.target_hidden_size}, the "
                         f"target's hidden_size is {target_config.hidden_size} (a head for "
                         f"another model?)")
    if (not any(f.endswith(".safetensors") for f in os.listdir(head_dir))
            and os.path.isfile(os.path.join(head_dir, "pytorch_model.bin"))):
        # EAGLE's own releases ship a torch pickle
        raise ValueError(f"{where}: only pytorch_model.bin, a torch pickle; Taper reads "
                         f"safetensors. Convert it once: python -c \"import torch; from "
                         f"safetensors.torch import save_file; save_file(torch.load("
                         f"'pytorch_model.bin'), 'model.safetensors')\"")
    weights = normalize_names(load_safetensors(head_dir, dtype=dtype, progress=progress))
    if "embed_tokens.weight" not in weights and config.hidden_size != target_config.hidden_size:
        raise ValueError(f"{where}: it has no embed_tokens, and the target's (hidden size "
                         f"{target_config.hidden_size}) does not fit its hidden size "
                         f"{config.hidden_size}")
    try:
        return Eagle3Head(config, weights, backend,
                          config.aux_layers_for(target_config.num_hidden_layers),
                          target.embed_tokens if target_embed is TARGETS else target_embed,
                          target_config.vocab_size,
                          target_config.max_model_len)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
