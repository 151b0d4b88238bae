"""Speculative decoding through the server: `python -m server --speculative-config ...` on the
random demo checkpoint answers greedy chat and completion requests (streamed or not) with exactly
the text and tokens of the same server without speculation (prompt lookup, the demo model as its
own draft, a random EAGLE-3 head), and the flags' errors name the flag."""
from __future__ import annotations

import json

import numpy as np
import pytest

from demo_live import demo_dir, live  # noqa: F401 (fixtures)
from server_fakes import LiveServer, client_for

pytestmark = pytest.mark.timeout(300)

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
# repetition_penalty < 1 (vLLM's extra parameter) makes the random model repeat itself, which
# prompt lookup predicts
EXTRA = {"repetition_penalty": 0.2, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_live(demo_dir, tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("spec"), demo_dir, "--mem", "64",
                        "--served-model-name", "demo", "--speculative-config", NGRAM)
    yield server
    server.close()


@pytest.fixture(scope="module")
def draft_live(demo_dir, tmp_path_factory):
    """The demo model as its own draft: --draft-model."""
    server = LiveServer(tmp_path_factory.mktemp("draft"), demo_dir, "--mem", "64",
                        "--served-model-name", "demo", "--draft-model", demo_dir)
    yield server
    server.close()


def chat(client, text: str, stream: bool, **kw):
    args = dict(model="demo", messages=[{"role": "user", "content": text}], max_tokens=48,
                temperature=0, extra_body=EXTRA, logprobs=True, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]
    text, tokens = "", []
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                tokens += [t.token for t in chunk.choices[0].logprobs.content]
    return text, tokens


def test_greedy_chat_and_completions_equal_the_server_without_speculation(live, spec_live):
    plain, spec = client_for(live.port), client_for(spec_live.port)
    prompts = ["Tell me about the sea and the sea and the sea.", "abc abc abc abc abc",
               "Write a list: one, two, three, one, two, three, one,"]
    for text in prompts:
        for stream in (False, True):
            want = chat(plain, text, stream)
            assert chat(spec, text, stream) == want
        args = dict(model="demo", prompt=text, max_tokens=40, temperature=0, extra_body=EXTRA)
        assert (spec.completions.create(**args).choices[0].text
                == plain.completions.create(**args).choices[0].text)
    # seeded sampling: prompt lookup's drafts keep the tokens of the same seed
    args = dict(model="demo", prompt=prompts[1], max_tokens=40, temperature=0.8, seed=7,
                extra_body=EXTRA, n=2)
    assert ([c.text for c in spec.completions.create(**args).choices]
            == [c.text for c in plain.completions.create(**args).choices])
    log = spec_live.log()
    assert "speculative decoding" in log


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith("taper:" + name + "{") and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_metrics_and_usage_count_drafts(live, spec_live):
    from server_fakes import http_request
    spec = client_for(spec_live.port)
    args = dict(model="demo", max_tokens=40, temperature=0, extra_body=EXTRA,
                messages=[{"role": "user", "content": "abc abc abc abc abc"}])
    usage = spec.chat.completions.create(**args).usage.model_extra["speculative_decoding"]
    assert usage["num_draft_tokens"] >= usage["num_accepted_tokens"] > 0
    assert usage["acceptance_rate"] == round(usage["num_accepted_tokens"]
                                             / usage["num_draft_tokens"], 4)
    assert usage["mean_accepted_length"] == round(1 + usage["num_accepted_tokens"]
                                                  / usage["num_drafts"], 4)
    streamed = [c for c in spec.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args) if c.usage]
    assert streamed[-1].usage.model_extra["speculative_decoding"] == usage   # greedy: the same
    plain = client_for(live.port).chat.completions.create(**args).usage
    assert "speculative_decoding" not in plain.model_extra
    text = http_request(spec_live.port, "GET", "/metrics")[2].decode()
    drafts = metric(text, "spec_decode_num_draft_tokens_total", method="ngram")
    accepted = metric(text, "spec_decode_num_accepted_tokens_total", method="ngram")
    assert drafts >= accepted >= 2 * usage["num_accepted_tokens"]
    assert metric(text, "spec_decode_acceptance_rate", method="ngram") == pytest.approx(
        accepted / drafts)
    assert metric(text, "spec_decode_mean_accepted_length", method="ngram") > 1
    assert metric(text, "spec_decode_num_accepted_tokens_per_pos_total", method="ngram",
                  position="0") > 0
    assert b"spec_decode" not in http_request(live.port, "GET", "/metrics")[2]


def test_a_draft_model_server_equals_the_server_without_speculation(live, draft_live):
    plain, spec = client_for(live.port), client_for(draft_live.port)
    for text in ("Tell me about the sea.", "Count: one, two,"):
        for stream in (False, True):
            assert chat(spec, text, stream) == chat(plain, text, stream)
        args = dict(model="demo", prompt=text, max_tokens=30, temperature=0.7, seed=3)
        assert (spec.completions.create(**args).choices[0].text
                == plain.completions.create(**args).choices[0].text)
    assert "draft model" in draft_live.log()


@pytest.fixture(scope="module")
def eagle_live(demo_dir, tmp_path_factory):
    """A random EAGLE-3 head for the demo model (hidden 128 over its 256, its own embedding,
    the demo's layers 1-3, a draft vocabulary of 3/4 of its ids)."""
    from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
    vocab = json.load(open(f"{demo_dir}/config.json"))["vocab_size"]
    cfg = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64, vocab_size=vocab, max_position_embeddings=4096)
    rng = np.random.default_rng(0)
    head = write_head(tmp_path_factory.mktemp("eagle3") / "head",
                      random_weights({**HEAD, **cfg}, target_hidden=256,
                                     draft_size=3 * vocab // 4),
                      draft_vocab(vocab, 3 * vocab // 4), target_vocab=vocab,
                      embed=rng.standard_normal((vocab, 128)) * 0.1, target_hidden_size=256,
                      eagle_aux_hidden_state_layer_ids=[1, 2, 3], **cfg)
    config = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    server = LiveServer(tmp_path_factory.mktemp("eagle"), demo_dir, "--mem", "64",
                        "--served-model-name", "demo", "--speculative-config", config)
    yield server
    server.close()


def test_an_eagle3_server_equals_the_server_without_speculation(live, eagle_live):
    plain, spec = client_for(live.port), client_for(eagle_live.port)
    for text in ("Tell me about the sea.", "Count: one, two,"):
        for stream in (False, True):
            assert chat(spec, text, stream) == chat(plain, text, stream)
        args = dict(model="demo", prompt=text, max_tokens=30, temperature=0.7, seed=3)
        assert (spec.completions.create(**args).choices[0].text
                == plain.completions.create(**args).choices[0].text)
    usage = spec.chat.completions.create(
        model="demo", max_tokens=30, temperature=0, extra_body=EXTRA,
        messages=[{"role": "user", "content": "abc"}]).usage
    assert usage.model_extra["speculative_decoding"]["num_draft_tokens"] > 0
    assert "EAGLE-3 head" in eagle_live.log()


def test_flags_name_the_problem():
    from server.__main__ import build_parser, engine_config
    p = build_parser()
    config = engine_config(p.parse_args(["--w", "/m", "--cpu", "--speculative-config", NGRAM]))
    assert (config.speculative_config.method,
            config.speculative_config.num_speculative_tokens) == ("ngram", 4)
    config = engine_config(p.parse_args(["--w", "/m", "--cpu", "--draft-model", "/d"]))
    assert (config.speculative_config.method, config.speculative_config.model) == (
        "draft_model", "/d")
    assert engine_config(p.parse_args(["--w", "/m", "--cpu"])).speculative_config is None
    with pytest.raises(ValueError, match="--speculative-config: .*unknown key 'lookahead'"):
        engine_config(p.parse_args(["--w", "/m", "--cpu", "--speculative-config",
                                    '{"method": "ngram", "lookahead": 2}']))
