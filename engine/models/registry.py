"""Architecture name (config.json `architectures`) -> model class, and the one-call loader."""
from __future__ import annotations

import importlib

# name -> (module under engine.models, class). Config differences between these (bias, q/k norm,
# sliding window, RoPE) are ModelConfig flags; Yi checkpoints say LlamaForCausalLM.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "MixtralForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MoeForCausalLM"),
}

# Headless transformers (embedding checkpoints: tensors without the "model." prefix, no lm_head)
# -> the causal LM whose graph and config rules they share.
BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


def get_model_class(name: str):
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name}; supported: {', '.join(sorted(ARCHITECTURES))}")
    module, cls = ARCHITECTURES[name]
    return getattr(importlib.import_module(f"engine.models.{module}"), cls)


def load_model(model_dir: str, backend, dtype: str = "auto", yarn_scaling_factor: float | None = None,
               progress: bool = True, isq: str | None = None):
    """(model, model_config) for a local checkpoint directory; `isq` quantizes its projection
    matrices at load (engine/loader/isq.py)."""
    from engine.loader.safetensors import load_safetensors
    from engine.model_config import ModelConfig

    model_config = ModelConfig.from_pretrained(model_dir, yarn_scaling_factor=yarn_scaling_factor)
    model_class = get_model_class(model_config.architecture)
    weights = load_safetensors(model_dir, dtype=dtype, progress=progress,
                               quantized=bool(model_config.quantization_config))
    if not any(name.startswith("model.") for name in weights):
        # The headless layout (LlamaModel.save_pretrained, and some embedding models that keep a
        # *ForCausalLM config over it): without an lm_head, an untied one cannot generate.
        from engine.loader.safetensors import add_model_prefix
        weights = add_model_prefix(weights)
        if "lm_head.weight" not in weights and not model_config.tie_word_embeddings:
            model_config.has_lm_head = False
    if model_config.quantization_config:
        from engine.loader.quant_formats import convert_quantized
        convert_quantized(weights, model_config.quantization_config)
    if isq:
        from engine.loader.isq import quantize_weights
        quantize_weights(weights, isq, progress=progress)
    model = model_class(model_config, weights, backend)
    return model, model_config


def load_gguf_model(path: str, backend, dtype: str = "auto",
                    yarn_scaling_factor: float | None = None, progress: bool = True,
                    isq: str | None = None):
    """(model, model_config, tokenizer or None) for a GGUF file (its first shard if split)."""
    from engine.loader.gguf import read_gguf
    from engine.model_config import ModelConfig

    ckpt = read_gguf(path, dtype=dtype, progress=progress)
    model_config = ModelConfig.from_dict(ckpt.config, yarn_scaling_factor=yarn_scaling_factor)
    if isq:
        from engine.loader.isq import quantize_weights
        quantize_weights(ckpt.weights, isq, progress=progress)
    model = get_model_class(model_config.architecture)(model_config, ckpt.weights, backend)
    return model, model_config, ckpt.tokenizer

