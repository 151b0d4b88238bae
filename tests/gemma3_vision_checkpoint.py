"""A tiny random Gemma 3 vision checkpoint written by transformers
(Gemma3ForConditionalGeneration.from_config + save_pretrained), with a byte-level BPE tokenizer
holding Gemma 3's turn and image special tokens (boi/eoi/image tokens named in its
tokenizer_config, as Gemma3Processor reads them), a chat template that renders an image part as
<start_of_image>, and the processor (Gemma3ImageProcessorPil + the tokenizer, image_seq_length =
mm_tokens_per_image) saved beside it.

Sizes: text hidden 96 (4 heads of 24, 2 KV heads), layers sliding (window 8, shorter than an
image's 16 tokens, so the sliding layers' mask differs from the full layers' inside an image)
and full; SigLIP hidden 32 (2 heads), 2 layers, 32-pixel images in patches of 4 (8 x 8 patches)
pooled 2 x 2 into 16 tokens. Weights scaled after init as the tiny family's; the projection,
zero at init, drawn at random. Untied embeddings: a tied random head with
Gemma's sqrt(hidden) embedding scale mostly predicts the last token again.
"""
from __future__ import annotations

SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
           "<end_of_image>", "<image_soft_token>"]

# Gemma 3's template, less the system-prompt folding and the role checks.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

TEXT = ["What is in this picture?\nDescribe the image in one sentence.\n\n",
        "A red square and a blue circle on a white background.\n\n\n",
        "Compare the two images:\n\nwhich one is brighter? The first one.\n\n\n\n"] * 20

IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 16
PROCESSOR = dict(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def build_tokenizer(path, split: str | None = None):
    """split: a regex splitting the text before the byte-level BPE, as Qwen2's tokenizer does
    (the GGUF fixtures: llama.cpp's vocabularies split by a regex)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # no pre-tokenizer split at newlines: runs of them merge into one token, as Gemma's do, so
    # the "\n\n" around an image merges with its neighbours only when expanded in the text
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
        additional_special_tokens=SPECIAL[3:], chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(path))
    return hf


def tiny_gemma3_vision_checkpoint(directory, seed: int = 0, scale: float = 4.0,
                                  text: dict | None = None, split: str | None = None,
                                  processor: dict | None = None) -> str:
    """text: text_config entries in place of the defaults below; split: build_tokenizer's (both
    for the GGUF fixtures, tests/data/make_gguf_gemma3_vl_fixtures.py); processor: image
    processor settings in place of PROCESSOR's (pan-and-scan)."""
    import torch
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration,
                              Gemma3ImageProcessorPil, Gemma3Processor)

    from checkpoints import scale_weights

    directory = str(directory)
    tok = build_tokenizer(directory, split)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Gemma3Config(
        text_config={**dict(
            hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], vocab_size=len(tok),
            max_position_embeddings=1024, rms_norm_eps=1e-5, pad_token_id=ids["<pad>"],
            bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}}),
            **(text or {})},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=4,
                           layer_norm_eps=1e-6, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    scale_weights(model, scale=scale, seed=seed)
    with torch.no_grad():
        w = model.model.multi_modal_projector.mm_input_projection_weight
        gen = torch.Generator().manual_seed(seed + 1)
        w.copy_(0.3 * torch.randn(w.shape, generator=gen))
    model.save_pretrained(directory)
    image_processor = Gemma3ImageProcessorPil(**{**PROCESSOR, **(processor or {})})
    Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                    image_seq_length=TOKENS_PER_IMAGE,
                    chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return directory
