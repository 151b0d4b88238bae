"""A tiny random Qwen2.5-VL checkpoint written by transformers (Qwen2_5_VLForConditionalGeneration
.from_config + save_pretrained), with a byte-level BPE tokenizer holding Qwen's vision special
tokens, Qwen2-VL's chat template (images as <|vision_start|><|image_pad|><|vision_end|>) and an
image processor config (Qwen2VLImageProcessorPil.save_pretrained).

Sizes: text hidden 96 (3 heads of 32, 1 KV head, M-RoPE sections 4/6/6 of the 16 frequencies),
vision hidden 32 (2 heads of 16), 4 blocks with full attention in blocks 1 and 3, patches of 4
pixels merged 2x2, windows of 16 pixels (2x2 merge groups), so an image of a few dozen pixels
a side has several windows, some cut by its edge. Weights scaled after init as the tiny family's.
"""
from __future__ import annotations

import numpy as np

from checkpoints import scale_weights

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL's template, less the video branch and the default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEXT = ["What is in this picture? Describe the image in one sentence.",
        "A red square and a blue circle on a white background.",
        "Compare the two images: which one is brighter? The first one."] * 20

PROCESSOR = dict(min_pixels=64, max_pixels=48 * 48, patch_size=4, merge_size=2,
                 temporal_patch_size=2)


def build_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:],
                                 chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(path))
    return hf


def tiny_vl_checkpoint(directory, seed: int = 0, scale: float = 4.0, text: dict | None = None,
                       **vision) -> str:
    """text: text_config entries that replace the defaults below (vision: vision_config's)."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    directory = str(directory)
    tok = build_tokenizer(directory)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, vocab_size=len(tok),
                         max_position_embeddings=1024, rms_norm_eps=1e-5,
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]}) | (text or {}),
        vision_config={**dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                              patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                              window_size=16, out_hidden_size=96, fullatt_block_indexes=[1, 3]),
                       **vision},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    scale_weights(model, scale=scale, seed=seed)
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return directory


def sample_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A PIL image of smooth colour gradients plus noise (so resizing changes every pixel)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1),
                     (x + y) * 127 // max(1, width + height - 2)], -1)
    noise = rng.integers(-40, 40, base.shape)
    arr = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(arr, "RGB")
    return image.convert(mode) if mode != "RGB" else image


def png_bytes(image) -> bytes:
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
