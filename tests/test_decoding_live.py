"""Logprobs, n > 1 and logit_bias through a live `python -m server` on the demo checkpoint, with
the official `openai` client: logprobs equal transformers' log-softmax (float32, 1e-4), prompt
ids come from an independent tokenizer (`tokenizers` on tokenizer.json), responses validate
against OpenAI's schemas, streams equal whole responses, choices equal separate seeded requests
with the prompt's prefill counted once (the server's prefix-cache metrics), and bad values are a
400 naming the parameter."""
from __future__ import annotations

import json
import os

import numpy as np
import openai
import pytest
import torch

from demo_live import client, demo_dir, live  # noqa: F401 (fixtures)
from server_fakes import assert_error, http_request, post_json, validate

pytestmark = pytest.mark.timeout(300)
TOL = 1e-4
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf(demo_dir):
    from hf_oracle import load_hf
    return load_hf(demo_dir)


@pytest.fixture(scope="module")
def tok(demo_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(demo_dir, "tokenizer.json"))


def chat_ids(tok, messages) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids


@torch.no_grad()
def hf_logprobs(hf, ids: list[int], bias: dict[int, float] | None = None) -> np.ndarray:
    logits = hf(torch.tensor([ids])).logits[0].double()
    for t, b in (bias or {}).items():
        logits[:, t] += b
    return torch.log_softmax(logits, -1).numpy()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int, bias: dict[int, float] | None = None) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(np.argmax(hf_logprobs(hf, ids + out, bias)[-1])))
    return out


def token_bytes(tok, token_id: int) -> bytes:
    """Independent of Taper: transformers' GPT-2 byte alphabet read backwards."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    back = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(back[c] for c in tok.id_to_token(token_id))


def same_entries(a, b) -> bool:
    """Chat logprob entries alike: the same tokens, logprobs within float rounding."""
    def key(e):
        return (e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs])

    def values(e):
        return [e.logprob] + [t.logprob for t in e.top_logprobs]
    return [key(e) for e in a] == [key(e) for e in b] and all(
        np.allclose(values(x), values(y), atol=1e-5) for x, y in zip(a, b))


def top(row: np.ndarray, k: int) -> list[int]:
    return np.argsort(-row, kind="stable")[:k].tolist()


# ---- chat

def test_chat_logprobs_equal_transformers(client, hf, tok):
    args = dict(model="demo", messages=MSGS, max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=5, extra_body={"ignore_eos": True})
    raw = client.chat.completions.with_raw_response.create(**args)
    body = json.loads(raw.text)
    validate(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    prompt = chat_ids(tok, MSGS)
    gen = hf_greedy(hf, prompt, 8)
    ref = hf_logprobs(hf, prompt + gen)
    P = len(prompt)
    assert len(content) == 8
    for i, entry in enumerate(content):
        row = ref[P - 1 + i]
        assert bytes(entry["bytes"]) == token_bytes(tok, gen[i])
        assert abs(entry["logprob"] - row[gen[i]]) < TOL
        want = top(row, 5)
        assert [bytes(t["bytes"]) for t in entry["top_logprobs"]] == \
            [token_bytes(tok, t) for t in want]
        np.testing.assert_allclose([t["logprob"] for t in entry["top_logprobs"]], row[want],
                                   atol=TOL)
    assert b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace") == \
        body["choices"][0]["message"]["content"]

    # streamed: the same entries, spread over schema-valid chunks (the repeat hits the prefix
    # cache, which may move a logprob by float rounding)
    chunks = list(client.chat.completions.create(**args, stream=True))
    for c in chunks:
        validate(c.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
    streamed = [e for c in chunks for ch in c.choices
                if ch.logprobs is not None for e in ch.logprobs.content]
    assert same_entries(streamed, raw.parse().choices[0].logprobs.content)
    # top_logprobs=0: the chosen tokens only
    zero = client.chat.completions.create(**{**args, "top_logprobs": 0})
    np.testing.assert_allclose([e.logprob for e in zero.choices[0].logprobs.content],
                               [e["logprob"] for e in content], atol=1e-5)
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)
    # no logprobs asked: none given
    assert client.chat.completions.create(model="demo", messages=MSGS, max_tokens=2
                                          ).choices[0].logprobs is None


def test_chat_prompt_logprobs_equal_transformers(client, hf, tok):
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
    pl = r.model_extra["prompt_logprobs"]
    prompt = chat_ids(tok, MSGS)
    ref = hf_logprobs(hf, prompt)
    assert pl[0] is None and len(pl) == len(prompt)
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        want = {prompt[j], *top(row, 2)}
        assert {int(t) for t in pl[j]} == want
        for t, v in pl[j].items():
            assert abs(v["logprob"] - row[int(t)]) < TOL
        assert pl[j][str(prompt[j])]["rank"] == 1 + int((row > row[prompt[j]]).sum())


def test_bytes_of_partial_characters_round_trip(client, hf, tok):
    """logit_bias limits the choice to the four byte tokens of 😀: every token is part of a
    character, its `bytes` are its byte (transformers' choice under the same bias), and the
    bytes joined decode to the content."""
    emoji = tok.encode("😀", add_special_tokens=False).ids
    assert len(emoji) == 4 and b"".join(token_bytes(tok, t) for t in emoji) == "😀".encode()
    bias = {t: 100.0 for t in emoji}
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=6, temperature=0,
                                       logprobs=True, logit_bias={str(t): 100 for t in emoji},
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    want = hf_greedy(hf, chat_ids(tok, MSGS), 6, bias)
    assert [bytes(e.bytes) for e in content] == [token_bytes(tok, t) for t in want]
    assert all(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in content)
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content


def test_no_logprobs_for_text_a_stop_string_withholds(client):
    """Tokens whose text a stop string cut off get no entry: the entries' bytes decode to exactly
    the returned content, though the tokens holding the stop string were generated."""
    args = dict(model="demo", messages=MSGS, max_tokens=12, temperature=1.0, seed=3,
                logprobs=True, extra_body={"ignore_eos": True})
    free = client.chat.completions.create(**args)
    text = free.choices[0].message.content
    # a two-character stop string first found past the middle of the free text
    k = next(k for k in range(len(text) // 2, len(text) - 1) if text.find(text[k:k + 2]) == k)
    stop = text[k:k + 2]
    for stream in (False, True):
        r = client.chat.completions.create(**args, stop=[stop], stream=stream)
        if stream:
            chunks = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            entries = [e for c in chunks for ch in c.choices if ch.logprobs
                       for e in ch.logprobs.content]
        else:
            content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
        assert content == text[:text.index(stop)]
        joined = b"".join(bytes(e.bytes) for e in entries)
        assert joined.decode("utf-8", errors="replace") == content
        assert len(entries) < 12
        assert same_entries(entries, free.choices[0].logprobs.content[:len(entries)])


# ---- completions

def test_completion_logprobs_with_echo_equal_transformers(client, hf, tok):
    prompt = "The capital of France is"
    ids = tok.encode(prompt).ids
    args = dict(model="demo", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    raw = client.completions.with_raw_response.create(**args)
    validate(json.loads(raw.text), "CreateCompletionResponse")
    plain = raw.parse().choices[0]
    gen = hf_greedy(hf, ids, 6)
    ref = hf_logprobs(hf, ids + gen)
    P = len(ids)
    lp = plain.logprobs
    assert lp.tokens == [tok.decode([t]) for t in gen]
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(P - 1, P + 5), gen], atol=TOL)
    for i, d in enumerate(lp.top_logprobs):
        row = ref[P - 1 + i]
        want = {tok.decode([t]): row[t] for t in [*top(row, 3), gen[i]]}
        assert d.keys() == want.keys()
        np.testing.assert_allclose([d[k] for k in want], list(want.values()), atol=TOL)
    assert lp.text_offset == [len(tok.decode(gen[:i])) for i in range(6)]

    echo = client.completions.create(**args, echo=True).choices[0]
    assert echo.text == prompt + plain.text
    e = echo.logprobs
    assert e.tokens == [tok.decode([t]) for t in ids] + lp.tokens
    assert e.token_logprobs[0] is None and e.top_logprobs[0] is None
    np.testing.assert_allclose(e.token_logprobs[1:P], ref[np.arange(P - 1), ids[1:]], atol=TOL)
    np.testing.assert_allclose(e.token_logprobs[P:], lp.token_logprobs, atol=1e-5)
    assert e.text_offset == [len(tok.decode(ids[:j])) for j in range(P)] + \
        [len(prompt) + o for o in lp.text_offset]

    # streamed: the same lists, chunk by chunk
    parts = list(client.completions.create(**args, echo=True, stream=True))
    joined = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for p in parts:
        for ch in p.choices:
            if ch.logprobs is not None:
                for k in joined:
                    joined[k] += getattr(ch.logprobs, k)
    assert joined["tokens"] == e.tokens and joined["text_offset"] == e.text_offset
    np.testing.assert_allclose(joined["token_logprobs"][1:], e.token_logprobs[1:], atol=1e-5)


# ---- n > 1

def metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    _, _, payload = http_request(port, "GET", "/metrics")
    return {s.name: s.value for fam in text_string_to_metric_families(payload.decode())
            for s in fam.samples if not s.labels.keys() - {"model_name"}}


def test_n_chat_choices_equal_seeded_requests(client, live, tok):
    """n=3, seed 21: choice i is the request alone with seed 21 + i; usage counts the prompt
    once; choices 1 and 2 take the prompt's full blocks from the prefix cache."""
    messages = [{"role": "user", "content": "Tell me a story about the little town by the sea "
                                            "and the fishermen who went out every morning."}]
    args = dict(model="demo", messages=messages, max_tokens=6, temperature=1.0,
                extra_body={"ignore_eos": True})
    P = len(chat_ids(tok, messages))
    before = metrics(live.port)
    raw = client.chat.completions.with_raw_response.create(**args, n=3, seed=21)
    validate(json.loads(raw.text), "CreateChatCompletionResponse")
    after = metrics(live.port)
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (P, 18)
    full = (P - 1) // 16 * 16
    hits = [k for k in after if k.endswith("prefix_cache_hits_total")][0]
    assert after[hits] - before[hits] == 2 * full
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    for i in range(3):
        alone = client.chat.completions.create(**args, seed=21 + i)
        assert alone.choices[0].message.content == texts[i]

    chunks = list(client.chat.completions.create(**args, n=3, seed=21, stream=True,
                                                 stream_options={"include_usage": True}))
    for c in chunks:
        validate(c.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
    streamed = ["".join(ch.delta.content or "" for c in chunks for ch in c.choices
                        if ch.index == i) for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.prompt_tokens == P and chunks[-1].usage.completion_tokens == 18
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.delta.role) == [0, 1, 2]


def test_n_completions_index_prompt_times_n(client):
    prompts = ["Once upon a time", "The answer is"]
    args = dict(model="demo", prompt=prompts, max_tokens=5, temperature=1.0, seed=4, n=2,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = client.completions.create(**{**args, "prompt": prompt, "n": 1, "seed": 4 + i})
            assert whole.choices[p * 2 + i].text == alone.choices[0].text
    parts = list(client.completions.create(**args, stream=True))
    assert ["".join(c.text for p in parts for c in p.choices if c.index == i)
            for i in range(4)] == [c.text for c in whole.choices]
    assert whole.usage.completion_tokens == 20


# ---- logit_bias and errors

def test_logit_bias_bans_the_greedy_token(client, hf, tok):
    prompt = chat_ids(tok, MSGS)
    first, second = top(hf_logprobs(hf, prompt)[-1], 2)
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1, temperature=0,
                                       logprobs=True, logit_bias={str(first): -100})
    assert bytes(r.choices[0].logprobs.content[0].bytes) == token_bytes(tok, second)
    # the raw logprobs stay the model's: the chosen token's is transformers' unbiased one
    assert abs(r.choices[0].logprobs.content[0].logprob -
               hf_logprobs(hf, prompt)[-1][second]) < TOL


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_values_are_400_naming_the_param(live, path, extra, param):
    base = {"messages": MSGS} if "chat" in path else {"prompt": "Hello"}
    status, body = post_json(live.port, path, {**base, "max_tokens": 2, **extra})
    assert_error(status, body, 400, param)
    if param == "logit_bias":
        assert next(iter(extra["logit_bias"])) in body["error"]["message"] or "101" in \
            body["error"]["message"]


def test_sdk_raises_bad_request_for_logit_bias(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSGS, logit_bias={"99999": 5})
    assert e.value.param == "logit_bias" and "99999" in e.value.message


def test_logprobs_mode_flag():
    from server.__main__ import build_parser, engine_config
    p = build_parser()
    assert engine_config(p.parse_args(["--w", "/m", "--cpu"])).logprobs_mode == "raw"
    args = p.parse_args(["--w", "/m", "--cpu", "--logprobs-mode", "processed"])
    assert engine_config(args).logprobs_mode == "processed"
    with pytest.raises(SystemExit):
        p.parse_args(["--logprobs-mode", "sampled"])
