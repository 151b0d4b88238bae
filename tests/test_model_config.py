"""config.json parsing (both RoPE forms, derived head_dim, sliding windows, flags) and the RoPE
cos/sin cache against transformers' own rotary embedding."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.models.model_config import ModelConfig
from engine.models.rotary import build_cos_sin_cache

BASE = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, rms_norm_eps=1e-5)


def cfg(arch="LlamaForCausalLM", **kw):
    return {"architectures": [arch], **BASE, **kw}


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2}


@pytest.mark.parametrize("kind,params", [("llama3", LLAMA3), ("yarn", YARN),
                                         ("linear", {"factor": 2.0})])
def test_nested_and_legacy_rope_forms_parse_the_same(kind, params):
    nested = ModelConfig.from_dict(cfg(rope_parameters={"rope_type": kind, "rope_theta": 5e5, **params}))
    legacy = ModelConfig.from_dict(cfg(rope_theta=5e5, rope_scaling={"type": kind, **params}))
    legacy2 = ModelConfig.from_dict(cfg(rope_theta=5e5, rope_scaling={"rope_type": kind, **params}))
    assert nested.rope == legacy.rope == legacy2.rope
    assert nested.rope.rope_type == kind and nested.rope.theta == 5e5
    assert nested.rope.factor == params["factor"]
    if kind != "linear":
        assert nested.rope.original_max_position_embeddings == 32


def test_rope_defaults():
    c = ModelConfig.from_dict(cfg())
    assert c.rope.rope_type == "default" and c.rope.theta == 10000.0 and c.rope.rot_dim == 24
    assert c.max_model_len == 128
    c = ModelConfig.from_dict(cfg(rope_theta=1e6, rope_scaling=None))
    assert c.rope.theta == 1e6
    # llama3/yarn without original_max_position_embeddings: max_position_embeddings (transformers)
    c = ModelConfig.from_dict(cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert c.rope.original_max_position_embeddings == 128 and c.max_model_len == 256


def test_head_dim_explicit_or_derived():
    from transformers import LlamaConfig, Qwen3Config
    assert ModelConfig.from_dict(cfg()).head_dim == 24 == LlamaConfig(**BASE).head_dim
    c = ModelConfig.from_dict(cfg(head_dim=32))
    assert c.head_dim == 32 and c.q_size == 128 and c.kv_size == 64
    # Qwen3Config's class default is 128, not hidden // heads
    assert ModelConfig.from_dict(cfg("Qwen3ForCausalLM")).head_dim == Qwen3Config(**BASE).head_dim == 128
    assert ModelConfig.from_dict(cfg(num_key_value_heads=None)).num_key_value_heads == 4


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict(cfg("GPTNeoXForCausalLM"))
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_yarn_scaling_factor_override():
    c = ModelConfig.from_dict(cfg(rope_theta=1e6), yarn_scaling_factor=4.0)
    assert c.rope.rope_type == "yarn" and c.rope.factor == 4.0 and c.rope.theta == 1e6
    assert c.rope.original_max_position_embeddings == 128 and c.max_model_len == 512
    c = ModelConfig.from_dict(cfg(rope_parameters={"rope_type": "yarn", **YARN}), yarn_scaling_factor=2.0)
    assert c.rope.factor == 2.0 and c.rope.original_max_position_embeddings == 32
    assert c.rope.beta_fast == 16  # the checkpoint's other yarn parameters stay
    c = ModelConfig.from_dict(cfg(rope_parameters={"rope_type": "llama3", **LLAMA3}), yarn_scaling_factor=2.0)
    assert c.rope.rope_type == "yarn" and c.rope.original_max_position_embeddings == 128


def test_arch_flags():
    llama = ModelConfig.from_dict(cfg(attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    assert llama.tie_word_embeddings
    qwen2 = ModelConfig.from_dict(cfg("Qwen2ForCausalLM"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_dict(cfg("Qwen3ForCausalLM"))
    assert (qwen3.qkv_bias, qwen3.qk_norm) == (False, True)
    mistral = ModelConfig.from_dict(cfg("MistralForCausalLM", attention_bias=True))
    assert not mistral.qkv_bias


def test_dtype_and_token_ids(tmp_path):
    assert ModelConfig.from_dict(cfg(torch_dtype="bfloat16")).dtype == "bfloat16"
    assert ModelConfig.from_dict(cfg(dtype="float16")).dtype == "float16"
    c = ModelConfig.from_dict(cfg(bos_token_id=1, eos_token_id=[2, 7]))
    assert c.bos_token_id == 1 and c.eos_token_ids == [2, 7]
    (tmp_path / "config.json").write_text(json.dumps(cfg(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == [2, 9]


def _hf_sliding_windows(arch_config):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(arch_config)
    return [layer.self_attn.sliding_window or 0 for layer in model.model.layers]


@pytest.mark.parametrize("extra", [
    dict(use_sliding_window=False, sliding_window=8),
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=8,
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    dict(use_sliding_window=False, sliding_window=8,
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
])
@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3"])
def test_qwen_sliding_window_layers_match_transformers(arch, extra):
    import transformers
    hf_config = getattr(transformers, f"{arch}Config")(**BASE, head_dim=24, **extra)
    d = json.loads(hf_config.to_json_string())
    d["architectures"] = [f"{arch}ForCausalLM"]
    d.pop("layer_types") if "layer_types" not in extra else None
    assert ModelConfig.from_dict(d).sliding_windows == _hf_sliding_windows(hf_config)


def test_mistral_window_applies_to_every_layer():
    assert ModelConfig.from_dict(cfg("MistralForCausalLM", sliding_window=16)).sliding_windows == [16] * 3
    assert ModelConfig.from_dict(cfg("MistralForCausalLM", sliding_window=None)).sliding_windows == [0] * 3
    assert ModelConfig.from_dict(cfg(sliding_window=16)).sliding_windows == [0] * 3  # Llama: none


# ---- the cos/sin cache against transformers' rotary embedding

def _hf_cos_sin(config_dict, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    hf = LlamaConfig(**{k: v for k, v in config_dict.items() if k != "architectures"})
    rotary = LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, len(positions), 1)
    cos, sin = rotary(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "llama3", **LLAMA3},
    {"rope_type": "yarn", **YARN},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
     "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "attention_factor": 1.3},
], ids=["default", "linear", "llama3", "yarn", "yarn_notrunc", "yarn_mscale", "yarn_attn"])
def test_cos_sin_cache_matches_transformers(rope):
    d = cfg(rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})})
    c = ModelConfig.from_dict(d)
    cache = build_cos_sin_cache(c.rope, c.max_position_embeddings, c.max_model_len)
    assert cache.dtype == np.float32 and cache.shape == (c.max_model_len, c.head_dim)
    positions = list(range(0, 128, 3))
    cos, sin = _hf_cos_sin(d, positions)
    half = c.head_dim // 2
    np.testing.assert_allclose(cache[positions, :half], cos, atol=2e-5)
    np.testing.assert_allclose(cache[positions, half:], sin, atol=2e-5)


def test_yarn_override_cache_equals_a_yarn_checkpoint():
    c = ModelConfig.from_dict(cfg(), yarn_scaling_factor=4.0)
    d = cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 128}, max_position_embeddings=512)
    cache = build_cos_sin_cache(c.rope, c.max_position_embeddings, c.max_model_len)
    positions = list(range(0, 512, 7))
    cos, sin = _hf_cos_sin(d, positions)
    np.testing.assert_allclose(cache[positions, :12], cos, atol=5e-5)
    np.testing.assert_allclose(cache[positions, 12:], sin, atol=5e-5)


def test_dynamic_rope_is_static_ntk_like_vllm():
    c = ModelConfig.from_dict(cfg(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                   "rope_theta": 10000.0}))
    assert c.max_model_len == 256
    cache = build_cos_sin_cache(c.rope, c.max_position_embeddings, c.max_model_len)
    dim = 24
    base = 10000.0 * (2.0 * 256 / 128 - 1.0) ** (dim / (dim - 2))
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    np.testing.assert_allclose(cache[200, :12], np.cos(200 * inv_freq), atol=1e-6)


def test_model_type_fallback_and_unsupported_quantization():
    d = cfg()
    del d["architectures"]
    assert ModelConfig.from_dict({**d, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    c = ModelConfig.from_dict(cfg(quantization_config={"quant_method": "gptq", "bits": 4}))
    assert c.quantization == "gptq" and c.quantization_config["bits"] == 4
    from engine.loader.quant_formats import convert_quantized
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; supported: gptq"):
        convert_quantized({}, {"quant_method": "bitsandbytes"})
