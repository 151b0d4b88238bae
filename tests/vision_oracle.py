"""The engine and transformers on one chat prompt with images (tests/test_vision.py,
tests/test_vision_qwen3.py): the prompt's ids with the image tokens expanded as the server
expands them, transformers' greedy tokens with how many of them to trust, the engine's."""
from __future__ import annotations

GEN = 10
TIE = 1e-4       # transformers' tokens are trusted up to a top-two log-prob gap under this


def make_engine(ckpt, **kw):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=ckpt, backend="cpu", kv_cache_memory_mb=16,
                                  async_scheduling=False, **kw))


def prompt_ids(hf, parts: list, processed: list) -> list[int]:
    """The chat prompt of one user message (text parts, None for an image), image tokens
    expanded (what the server sends); hf = (model, image processor, tokenizer)."""
    tok = hf[2]
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
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
    with torch.no_grad():
        g = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           mm_token_type_ids=mm, max_new_tokens=n, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, **kwargs)
    tokens = g.sequences[0, len(ids):].tolist()
    trusted = n
    for i, s in enumerate(g.scores):
        top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
        if float(top2[0] - top2[1]) < TIE:
            trusted = i
            break
    return tokens, trusted


def run(engine, ids, images, n: int = GEN, request_id: str = "r"):
    """The engine's sequence for the prompt, greedy, n tokens."""
    from engine.sampling.sampling_params import SamplingParams
    seq = engine.add_request(request_id, ids, SamplingParams(max_tokens=n, temperature=0,
                                                             ignore_eos=True), images=images)
    while engine.has_unfinished():
        engine.step()
    return seq
