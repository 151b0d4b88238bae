"""Tiny random Qwen3-VL checkpoints, dense and MoE, written by transformers
(Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration .from_config +
save_pretrained), with tests/vision_checkpoint.py's tokenizer and chat template and a Qwen3-VL
style image processor config (Qwen2VLImageProcessorPil.save_pretrained: mean and std 0.5, the
pixel limits as size's shortest_edge / longest_edge).

Sizes: text hidden 96 (3 heads of 32, 1 KV head, 3 layers, interleaved M-RoPE sections 6/5/5 of
the 16 frequencies; MoE: 4 experts of 32, top 2, layer 1 dense), vision hidden 32 (2 heads of
16), 4 blocks with DeepStack features from blocks 0 and 2 (so into LM layers 0 and 1), patches
of 4 pixels merged 2x2, a 4x4 learned position grid (so every image's grid is interpolated).
Weights scaled after init as the tiny family's.
"""
from __future__ import annotations

from checkpoints import scale_weights
from vision_checkpoint import SPECIAL, build_tokenizer

PROCESSOR = dict(size={"shortest_edge": 64, "longest_edge": 48 * 48}, patch_size=4,
                 merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def tiny_qwen3_vl_checkpoint(directory, moe: bool = False, seed: int = 0,
                             scale: float = 4.0, text_overrides: dict | None = None,
                             vision_overrides: dict | None = None) -> str:
    """text_overrides: text_config entries in place of the ones below (the GGUF fixtures:
    llama.cpp's qwen3vlmoe has experts in every layer); vision_overrides: vision_config's."""
    import torch
    from transformers import (Qwen2VLImageProcessorPil, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)

    directory = str(directory)
    tok = build_tokenizer(directory)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                num_attention_heads=3, num_key_value_heads=1, head_dim=32, vocab_size=len(tok),
                max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=None,
                eos_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [6, 5, 5], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    mlp_only_layers=[1])
    text.update(text_overrides or {})
    config_class, model_class = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                                 else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=96,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    vision.update(vision_overrides or {})
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    scale_weights(model, scale=scale, seed=seed)
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return directory


def to_hub_expert_layout(directory) -> None:
    """In place: the checkpoint's stacked experts as the hub's Qwen3-VL-MoE files hold them,
    gate_up_proj (E, H, 2I) and down_proj (E, I, H) (transformers 5 saves (E, 2I, H) and
    (E, H, I); its loader transposes either back)."""
    import os

    from safetensors.numpy import load_file, save_file
    path = os.path.join(str(directory), "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj",
                                                   ".mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(0, 2, 1).copy()
    save_file(tensors, path, metadata={"format": "pt"})
