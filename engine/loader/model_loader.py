"""The one-call loaders: a checkpoint (safetensors directory or GGUF file) read, its quantized
formats converted, --isq applied, and the model graph built on a backend."""
from __future__ import annotations

from engine.loader.gguf import read_gguf
from engine.loader.isq import quantize_weights
from engine.loader.quant_formats import convert_quantized
from engine.loader.safetensors import add_model_prefix, load_safetensors
from engine.models.model_config import ModelConfig
from engine.models.registry import get_model_class
from engine.parallel.sharding import ShardPlan, check_isq_split


def load_model(model_dir: str, backend, dtype: str = "auto",
               yarn_scaling_factor: float | None = None, progress: bool = True,
               isq: str | None = None, tensor_parallel=None):
    """(model, model_config) for a local checkpoint directory; `isq` quantizes its projection
    matrices at load (engine/loader/isq.py). tensor_parallel: (rank, size, communicator): the
    rank's share of the model is read and built (engine/parallel/sharding.py); the config
    returned is the whole model's."""
    model_config = ModelConfig.from_pretrained(model_dir, yarn_scaling_factor=yarn_scaling_factor)
    model_class = get_model_class(model_config.architecture)
    plan = _plan(model_config, tensor_parallel)
    weights = load_safetensors(model_dir, dtype=dtype, progress=progress,
                               quantized=bool(model_config.quantization_config),
                               shard=plan and plan.shard)
    if not any(name.startswith("model.") for name in weights):
        # The headless layout (LlamaModel.save_pretrained, and some embedding models that keep a
        # *ForCausalLM config over it): without an lm_head, an untied one cannot generate.
        weights = add_model_prefix(weights)
        if "lm_head.weight" not in weights and not model_config.tie_word_embeddings:
            model_config.has_lm_head = False
    if model_config.quantization_config:
        convert_quantized(weights, model_config.quantization_config)
    if isq:
        if plan is not None:
            check_isq_split(plan, weights, isq)
        quantize_weights(weights, isq, progress=progress)
    model = model_class(_local(model_config, plan, tensor_parallel), weights, backend)
    return model, model_config


def load_gguf_model(path: str, backend, dtype: str = "auto",
                    yarn_scaling_factor: float | None = None, progress: bool = True,
                    isq: str | None = None, tensor_parallel=None):
    """(model, model_config, tokenizer or None) for a GGUF file (its first shard if split);
    tensor_parallel as load_model's."""
    ckpt = read_gguf(path, dtype=dtype, progress=progress)
    model_config = ModelConfig.from_dict(ckpt.config, yarn_scaling_factor=yarn_scaling_factor)
    plan = _plan(model_config, tensor_parallel)
    weights = ckpt.weights
    if plan is not None:        # the tensors are memory-mapped: cut before they are read
        shapes = {n: w.shape for n, w in weights.items()}
        weights = {n: plan.shard(n, w, shapes) for n, w in weights.items()}
    if isq:
        if plan is not None:
            check_isq_split(plan, weights, isq)
        quantize_weights(weights, isq, progress=progress)
    model = get_model_class(model_config.architecture)(
        _local(model_config, plan, tensor_parallel), weights, backend)
    return model, model_config, ckpt.tokenizer


def _plan(model_config: ModelConfig, tensor_parallel) -> ShardPlan | None:
    if tensor_parallel is None:        # (a group of one is still split: the GPU suite's check)
        return None
    rank, size, _ = tensor_parallel
    return ShardPlan(model_config, rank, size)


def _local(model_config: ModelConfig, plan: ShardPlan | None, tensor_parallel) -> ModelConfig:
    """The config the rank's model is built with."""
    return model_config if plan is None else plan.local_config(tensor_parallel[2])

