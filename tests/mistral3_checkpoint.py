"""A tiny random Mistral 3 vision checkpoint written by transformers
(Mistral3ForConditionalGeneration.from_config + save_pretrained), with a byte-level BPE tokenizer
holding Pixtral's image tokens ([IMG], [IMG_BREAK], [IMG_END]), a Mistral-style chat template
(each image as one [IMG], which the processor expands), the image processor's config
(PixtralImageProcessorPil.save_pretrained) and the processor's (processor_config.json with the
keys PixtralProcessor.save_pretrained writes: PixtralProcessor itself needs torchvision).

Sizes: text hidden 96 (6 heads of 16, 2 KV heads), vision hidden 32 (2 heads of 16), 3 layers,
patches of 4 pixels merged 2x2, so the processor resizes to multiples of 8 pixels with the
longest edge at most 48: an image of a few dozen pixels a side is a few rows of a few image
tokens. Weights scaled after init as the tiny family's.
"""
from __future__ import annotations

import json
import os

from checkpoints import scale_weights

SPECIAL = ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]

# Mistral's template, less the system prompt and tools: images as [IMG].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}[IMG]"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}")

TEXT = ["What is in this picture? Describe the image in one sentence.",
        "A red square and a blue circle on a white background.",
        "Compare the two images: which one is brighter? The first one."] * 20

PATCH, MERGE, LONGEST_EDGE = 4, 2, 48

PROCESSOR = dict(image_token="[IMG]", image_break_token="[IMG_BREAK]",
                 image_end_token="[IMG_END]", patch_size=PATCH, spatial_merge_size=MERGE,
                 processor_class="PixtralProcessor")


def build_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", additional_special_tokens=SPECIAL[3:],
                                 chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(path))
    return hf


def tiny_mistral3_checkpoint(directory, seed: int = 0, scale: float = 4.0, **config) -> str:
    import torch
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration,
                              PixtralImageProcessorPil)

    directory = str(directory)
    tok = build_tokenizer(directory)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Mistral3Config(
        text_config=dict(model_type="mistral", hidden_size=96, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16, vocab_size=len(tok), max_position_embeddings=1024,
                         rms_norm_eps=1e-5, sliding_window=None, bos_token_id=ids["<s>"],
                         eos_token_id=ids["</s>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, patch_size=PATCH,
                           image_size=LONGEST_EDGE, hidden_act="silu",
                           rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
        image_token_index=ids["[IMG]"], spatial_merge_size=MERGE,
        multimodal_projector_bias=True, tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config)
    scale_weights(model, scale=scale, seed=seed)
    model.save_pretrained(directory)
    PixtralImageProcessorPil(patch_size={"height": PATCH, "width": PATCH},
                             size={"longest_edge": LONGEST_EDGE}).save_pretrained(directory)
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump(PROCESSOR, f, indent=2)
    return directory
