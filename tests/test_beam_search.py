"""Beam search against transformers' `generate(num_beams=W, length_penalty, early_stopping,
do_sample=False)` on a tiny float32 checkpoint: the same tokens for each setting (and the n best
with num_return_sequences), with extra end tokens that make hypotheses finish early; beams share
the prompt's KV blocks (the prompt is computed once) and free every block at the end. Through the
live server with the official client: completions with use_beam_search equal transformers, and
streaming with beam search is a 400."""
from __future__ import annotations

import os

import numpy as np
import openai
import pytest
import torch

from demo_live import demo_dir  # noqa: F401 (fixture)
from engine import LLM, SamplingParams
from hf_oracle import load_hf
from server_fakes import LiveServer, assert_error, client_for, post_json
from tiny_llama import hf, model_dir  # noqa: F401 (fixtures)

EOS = 2      # the tiny checkpoint's


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=8)


def prompt_for(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, 13 + 5 * seed).tolist()


@torch.no_grad()
def hf_beams(hf, prompt, W, n, max_tokens, length_penalty, early_stopping, ends=(EOS,)):
    out = hf.generate(torch.tensor([prompt]), num_beams=W, num_return_sequences=n,
                      length_penalty=length_penalty, early_stopping=early_stopping,
                      do_sample=False, max_new_tokens=max_tokens, eos_token_id=list(ends),
                      pad_token_id=0)
    # finished hypotheses are padded with the first end id after their end token
    seqs = []
    for row in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        seqs.append(row[:end])
    return seqs


def beam_outputs(llm, prompt, **kw) -> list:
    out = llm.generate([prompt], SamplingParams(use_beam_search=True, **kw))[0]
    return out if isinstance(out, list) else [out]


# (seed, width, length_penalty, early_stopping, max_tokens, an extra end token or None)
CASES = [(0, 3, 1.0, False, 10, None), (1, 4, 0.5, True, 12, None), (2, 2, 2.0, "never", 8, None),
         (3, 4, -1.0, False, 16, None), (0, 3, 1.0, False, 10, 416), (1, 4, 0.5, True, 12, 487),
         (2, 2, 2.0, "never", 8, 389), (0, 3, 0.0, "never", 10, 416)]


@pytest.mark.parametrize("seed, W, lp, es, max_tokens, end", CASES)
def test_beam_search_equals_transformers(llm, hf, seed, W, lp, es, max_tokens, end):
    prompt = prompt_for(seed)
    ends = (EOS,) if end is None else (EOS, end)
    stop = [] if end is None else [end]
    for n in (1, 2):
        got = beam_outputs(llm, prompt, best_of=W, n=n, max_tokens=max_tokens, length_penalty=lp,
                           early_stopping=es, stop_token_ids=stop)
        want = hf_beams(hf, prompt, W, n, max_tokens, lp, es, ends)
        assert [o.token_ids for o in got] == want
        assert [o.finish_reason for o in got] == \
            ["stop" if w[-1] in ends else "length" for w in want]
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_beam_search_is_not_greedy_and_can_fail(llm, hf):
    """The comparison can fail: for these prompts the beam's tokens differ from greedy ones,
    and a different width gives transformers a different answer."""
    prompt = prompt_for(0)
    beam = beam_outputs(llm, prompt, best_of=3, max_tokens=10)[0].token_ids
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True))[0].token_ids
    assert beam != greedy
    assert hf_beams(hf, prompt, 2, 1, 10, 1.0, False) != [beam]


def test_beams_share_the_prompt_kv(model_dir):
    """The prompt is computed once: the beams fork its blocks, and each step computes one token
    per beam."""
    llm = LLM(model_dir, block_size=8)
    prompt = prompt_for(3)                 # 28 tokens: 3 full blocks and a partial one
    W, max_tokens = 4, 6
    before = llm.engine.runner.num_forward_tokens
    out = beam_outputs(llm, prompt, best_of=W, max_tokens=max_tokens)[0]
    assert len(out.token_ids) == max_tokens
    computed = llm.engine.runner.num_forward_tokens - before
    assert computed == len(prompt) + W * (max_tokens - 1)


def test_beam_search_refuses_what_it_does_not_do():
    for kw, param in (({"logprobs": 1}, "logprobs"), ({"stop": ["x"]}, "stop"),
                      ({"n": 3, "best_of": 2}, "best_of"), ({"early_stopping": "soon"},
                                                            "early_stopping")):
        with pytest.raises(ValueError, match=param):
            SamplingParams(use_beam_search=True, **kw)


# ---- through the server

def test_live_beam_search_equals_transformers(demo_dir, tmp_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(demo_dir, "tokenizer.json"))
    hf_demo = load_hf(demo_dir)
    eos = [t for t in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))]
    server = LiveServer(tmp_path, demo_dir, "--mem", "64", "--served-model-name", "demo")
    try:
        client = client_for(server.port)
        prompt = "Once upon a time there was"
        ids = tok.encode(prompt).ids
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=8, n=2,
                                      extra_body={"use_beam_search": True, "best_of": 3,
                                                  "length_penalty": 0.7})
        want = hf_beams(hf_demo, ids, 3, 2, 8, 0.7, False, eos)
        assert [c.text for c in r.choices] == [tok.decode(w) for w in want]
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == sum(len(w) for w in want)
        status, body = post_json(server.port, "/v1/completions",
                                 {"prompt": prompt, "use_beam_search": True, "stream": True})
        assert_error(status, body, 400, "stream")
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="demo", prompt=prompt, logprobs=1,
                                      extra_body={"use_beam_search": True})
        assert e.value.param == "logprobs"
    finally:
        server.close()
