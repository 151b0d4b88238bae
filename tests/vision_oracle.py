"""The engine and transformers on one chat prompt with images (tests/test_vision.py,
tests/test_vision_qwen3.py, tests/test_vision_mistral3.py, tests/test_gemma3_vision.py): the
prompt's ids with the image tokens expanded as the server expands them, transformers' greedy
tokens with how many of them to trust, the engine's; the checks those families share."""
from __future__ import annotations

import numpy as np

from pyx.backend import Backend
from vision_checkpoint import sample_image

GEN = 10
TIE = 1e-4       # transformers' tokens are trusted up to a top-two log-prob gap under this

# (message parts: text, or None for an image; image sizes)
CASES = {
    "one image": (["What is in this picture?", None, " Describe it."], [(40, 56)]),
    "two images": ([None, "Compare the two images:", None, "which one is brighter?"],
                   [(23, 31), (48, 40)]),
}


def case_images(sizes: list, first_seed: int = 5) -> list:
    return [sample_image(*s, seed=i + first_seed) for i, s in enumerate(sizes)]


def one_pixel_changed(image):
    """The image with one pixel inverted: the same size, so the same prompt ids."""
    from PIL import Image
    changed = np.asarray(image).copy()
    changed[10, 10] = 255 - changed[10, 10]
    return Image.fromarray(changed)


def messages(parts: list) -> list[dict]:
    """One user message of text parts, None for an image."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


class BareBackend(Backend):
    """A backend that leaves every op to the op table's base class (loading must refuse it)."""
    def __init__(self):
        Backend.__init__(self, "bare")


class GeluOnlyBackend(BareBackend):
    """A bare backend with gelu of its own: the towers that also need encoder_attention refuse
    it."""
    def gelu(self, x, out):
        pass


def check_backends_refused(model_class, ckpt, refusals: list) -> None:
    """Building model_class from the checkpoint on each (backend, message)'s backend raises a
    ValueError matching message."""
    import pytest

    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    config = ModelConfig.from_pretrained(ckpt)
    for backend, message in refusals:
        with pytest.raises(ValueError, match=message):
            model_class(config, load_safetensors(ckpt, progress=False), backend)


def make_engine(ckpt, **kw):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=ckpt, backend="cpu", kv_cache_memory_mb=16,
                                  async_scheduling=False, **kw))


def prompt_ids(hf, parts: list, processed: list) -> list[int]:
    """The chat prompt of one user message (text parts, None for an image), image tokens
    expanded (what the server sends); hf = (model, image processor, tokenizer)."""
    tok = hf[2]
    text = tok.apply_chat_template(messages(parts), tokenize=False, add_generation_prompt=True)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    out, it = [], iter(processed)
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        out += [t] * next(it).num_tokens if t == image_id else [t]
    return out


def hf_generate(hf, ids: list[int], images: list, n: int = GEN):
    """transformers' greedy tokens and how many are trusted (top-two gap over TIE)."""
    import torch
    model, ip, _ = hf
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        out = ip(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    mm = (input_ids == model.config.image_token_id).int()
    return greedy_with_trust(model, n, input_ids=input_ids,
                             attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm,
                             **kwargs)


def greedy_with_trust(model, n: int, **inputs):
    """transformers' generate, greedy, n tokens after inputs["input_ids"]: the tokens and how
    many of them are trusted (up to the first step whose top-two log-prob gap is under TIE)."""
    import torch
    with torch.no_grad():
        g = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    tokens = g.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    trusted = n
    for i, s in enumerate(g.scores):
        top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
        if float(top2[0] - top2[1]) < TIE:
            trusted = i
            break
    return tokens, trusted


def run(engine, ids, images, n: int = GEN, request_id: str = "r", logprobs: list | None = None):
    """The engine's sequence for the prompt, greedy, n tokens; `logprobs`, a list, gets each
    token's logprob."""
    from engine.sampling.sampling_params import SamplingParams
    seq = engine.add_request(request_id, ids, SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True,
        logprobs=None if logprobs is None else 0), images=images)
    while engine.has_unfinished():
        for out in engine.step():
            if logprobs is not None:
                logprobs += [lp.logprob for lp in out.logprobs or ()]
    return seq


def check_greedy_case(ckpt, hf, preprocess, name):
    """A CASES prompt through chunked prefill (chunks of 32 tokens cut the images' runs), then
    decodes: transformers' tokens up to its first near-tie; each image encoded once, though
    chunks split its tokens (the encoder cache)."""
    parts, sizes = CASES[name]
    images = case_images(sizes)
    processed = [preprocess(im) for im in images]
    ids = prompt_ids(hf, parts, processed)
    tokens, trusted = hf_generate(hf, ids, images)
    assert trusted >= 6, f"reference near-tie at token {trusted}"
    engine = make_engine(ckpt, max_num_batched_tokens=32)
    seq = run(engine, ids, processed)
    assert seq.output_token_ids[:trusted] == tokens[:trusted]
    assert engine.runner.vision.num_encoded == len(images)


def check_prefix_cache_keys(ckpt, hf, ids, a, b, c, changed_reference):
    """a and b: the same image processed twice, c: one pixel changed, each the processed images
    of the prompt ids. The second request's prompt blocks come from the cache and give the
    first's tokens without encoding the image again; c shares no block past the image's first,
    and its tokens are changed_reference's (transformers' tokens for c, how many trusted)."""
    engine = make_engine(ckpt)
    first = run(engine, ids, a, request_id="a")
    again = run(engine, ids, b, request_id="b")
    image_start = ids.index(hf[0].config.image_token_id)
    bs = engine.block_pool.block_size
    assert again.num_cached_tokens == (len(ids) - 1) // bs * bs > image_start
    assert again.output_token_ids == first.output_token_ids
    assert engine.runner.vision.num_encoded == 1        # b computed no image token
    changed_seq = run(engine, ids, c, request_id="c")
    assert changed_seq.num_cached_tokens == image_start // bs * bs
    assert engine.runner.vision.num_encoded == 2
    tokens, trusted = changed_reference
    assert changed_seq.output_token_ids[:trusted] == tokens[:trusted]


def check_mrope_positions(ckpt, hf, processed, ids):
    """M-RoPE positions of the prompt (text rows one index, image rows their t, h, w) and its
    rope delta are transformers' get_rope_index's; returns the prompt's MultimodalPrompt, its
    text positions and the whole (len(ids), 3) table."""
    import torch

    from engine.models.model_config import ModelConfig
    from engine.vision.inputs import MultimodalPrompt
    model = hf[0]
    input_ids = torch.tensor([ids])
    grid = torch.tensor([p.grid_thw for p in processed])
    ref, delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
        image_grid_thw=grid)
    mm = MultimodalPrompt.place(ids, processed, ModelConfig.from_pretrained(ckpt).vision)
    pos, rows, triples, _ = mm.rope_positions(0, len(ids))
    full = np.repeat(pos[:, None], 3, 1)
    full[rows] = triples
    assert np.array_equal(full.T, ref[:, 0].numpy())
    assert mm.rope_delta == int(delta[0, 0])
    return mm, pos, full
