"""Architecture name (config.json `architectures`) -> model class (loading: engine/loader/)."""
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
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "MixtralForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MoeForCausalLM"),
    # vision-language (engine/vision/): images in, text out
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
    # hybrid: gated DeltaNet layers beside gated full attention
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
}

# Headless transformers (embedding checkpoints: tensors without the "model." prefix, no lm_head)
# -> the causal LM whose graph and config rules they share.
BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


# Multimodal checkpoints served for their text: their config.json nests the language model's
# under text_config, their tensors under model.language_model. (the vision tower is not loaded;
# the family's file renames them).
TEXT_MODELS: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",    # tensors under language_model.
}


def get_model_class(name: str):
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name}; supported: {', '.join(sorted(ARCHITECTURES))}")
    module, cls = ARCHITECTURES[name]
    return getattr(importlib.import_module(f"engine.models.{module}"), cls)
