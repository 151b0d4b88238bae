"""Structured outputs below the HTTP layer: the `apply_token_bitmask` op against the float64
oracle, the grammar compiler (cache, errors), and the engine on a random-weight checkpoint whose
model vocabulary is padded past its tokenizer and whose tokenizer declares <think> / </think>.

The engine's outputs are checked against an independent matcher: the test builds its own
llguidance tokenizer and matcher from the checkpoint's tokenizer.json and the schema, and checks
that every generated token (the final EOS included) was allowed at its step. The same requests
without the constraint show what the mask changes: free output is never JSON, and padding ids
favoured by logit_bias are sampled."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

import reference as ref
from engine import LLM, SamplingParams
from engine.sampling.structured_outputs import (JSON_DEFAULTS, GrammarCompiler,
                                                StructuredOutputsParams, json_spec)
from pyx.cpu_backend import CpuBackend

pytestmark = pytest.mark.timeout(300)


# ---- the op

@pytest.mark.parametrize("B, V, rows", [(1, 1, [0]), (2, 31, [1]), (3, 32, [0, 2]),
                                        (4, 1000, [3, 0, 1]), (2, 33000, [0, 1]),
                                        (3, 151_936 // 8 + 5, [2]), (2, 64, [])])
def test_apply_token_bitmask_matches_reference(B, V, rows):
    rng = np.random.default_rng(B * V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    W = (V + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(B, W), dtype=np.int64).astype(np.int32)
    bitmask[:, 0] = -1                       # all-ones words: the kernel's shortcut
    if W > 2:
        bitmask[:, 1] = 0
    rows = np.array(rows, dtype=np.int32)
    out = logits.copy()
    CpuBackend().apply_token_bitmask(out, bitmask, rows)
    want = ref.apply_token_bitmask(logits, bitmask, rows)
    np.testing.assert_array_equal(out.astype(np.float64), want)
    # rows not listed are untouched, bit for bit
    others = [b for b in range(B) if b not in set(rows.tolist())]
    assert out[others].tobytes() == logits[others].tobytes()


def test_apply_token_bitmask_rejects_bad_arguments():
    be = CpuBackend()
    logits = np.zeros((2, 40), dtype=np.float32)
    mask = np.full((2, 2), -1, dtype=np.int32)
    with pytest.raises(ValueError, match=r"apply_token_bitmask: need bitmask \(B, ceil"):
        be.apply_token_bitmask(logits, np.full((2, 1), -1, dtype=np.int32),
                               np.array([0], dtype=np.int32))
    with pytest.raises(ValueError, match="row index is outside"):
        be.apply_token_bitmask(logits, mask, np.array([2], dtype=np.int32))
    with pytest.raises(ValueError, match="bitmask has dtype uint32"):
        be.apply_token_bitmask(logits, mask.view(np.uint32), np.array([0], dtype=np.int32))


# ---- a random checkpoint with a padded vocabulary and reasoning tokens

THINK, END_THINK = "<think>", "</think>"
NUM_PADDING = 45


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The demo checkpoint (random weights) plus <think> and </think> added to its tokenizer
    and NUM_PADDING model-only ids (rows of embed_tokens and lm_head no token maps to)."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    from server.demo_model import write_demo_checkpoint
    d = Path(write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo")))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens([AddedToken(THINK, special=False), AddedToken(END_THINK, special=False)])
    tok.save(str(d / "tokenizer.json"))
    n = tok.get_vocab_size()
    V = n + NUM_PADDING
    w = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        a = w[name]
        extra = (rng.standard_normal((V - a.shape[0], a.shape[1])) * a.std()).astype(a.dtype)
        w[name] = np.concatenate([a, extra])
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    config["vocab_size"] = V
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), backend="cpu", kv_cache_memory_mb=32)


def independent_matcher(ckpt: Path, llm: LLM, grammar: str) -> tuple[LLMatcher, int]:
    """A matcher the test builds itself: llguidance's tokenizer from tokenizer.json, sized to
    the model's vocabulary. Returns it and the tokenizer's own size."""
    from tokenizers import Tokenizer
    rust = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    V = llm.engine.model_config.vocab_size
    lt = LLTokenizer(rust.to_str(), n_vocab=V, eos_token=sorted(llm.engine.eos_token_ids))
    return LLMatcher(lt, grammar, log_level=0), rust.get_vocab_size()


def assert_every_token_allowed(matcher: LLMatcher, num_tokens: int, token_ids: list[int]):
    for i, t in enumerate(token_ids):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        assert t < num_tokens, f"token {i} = {t} is a padding id"
        assert bits[t], f"token {i} = {t} was not allowed by the grammar"
        assert matcher.consume_token(t), t
    assert matcher.is_accepting()


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                  "maxItems": 3}},
          "required": ["name", "color", "tags"], "additionalProperties": False}


def json_params(seed: int, **kw) -> SamplingParams:
    kw = {"temperature": 1.0, "max_tokens": 80, **kw}
    return SamplingParams(seed=seed, **kw,
                          structured_outputs=StructuredOutputsParams("json", json_spec(SCHEMA)))


def padding_bias(llm: LLM) -> dict[int, float]:
    n = len(llm.engine.tokenizer.hf)
    return {t: 30.0 for t in range(n, llm.engine.model_config.vocab_size)}


def test_free_output_is_not_json_and_samples_padding_ids(llm):
    n = len(llm.engine.tokenizer.hf)
    for seed in range(3):
        out = llm.generate("Tell me about the sea.", SamplingParams(
            temperature=1.0, seed=seed, max_tokens=40, logit_bias=padding_bias(llm)))[0]
        assert any(t >= n for t in out.token_ids)       # the bias makes padding ids win
        out = llm.generate("Tell me about the sea.", SamplingParams(
            temperature=1.0, seed=seed, max_tokens=40))[0]
        with pytest.raises(ValueError):
            json.loads(out.text)


@pytest.mark.parametrize("greedy", [False, True])
def test_json_schema_output_validates_and_every_token_was_allowed(llm, ckpt, greedy):
    for seed in range(3):
        params = json_params(seed, logit_bias=padding_bias(llm))
        if greedy:
            params.temperature = 0.0
        out = llm.generate("Tell me about the sea.", params)[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids[-1] in llm.engine.eos_token_ids
        grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_DEFAULTS)
        matcher, n = independent_matcher(ckpt, llm, grammar)
        assert_every_token_allowed(matcher, n, out.token_ids)


def test_regex_choice_and_lark_grammar(llm, ckpt):
    cases = [("regex", r"[a-z]{2,5}-[0-9]{2}", None),
             ("choice", json.dumps(["sunny", "rainy day", "fog"]), None),
             ("grammar", 'start: "x=" NUM (" + " NUM)*\nNUM: /[1-9][0-9]?/', None)]
    import re
    patterns = {"regex": r"[a-z]{2,5}-[0-9]{2}", "choice": r"sunny|rainy day|fog",
                "grammar": r"x=[1-9][0-9]?( \+ [1-9][0-9]?)*"}
    for kind, spec, _ in cases:
        for seed in range(2):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                    structured_outputs=StructuredOutputsParams(kind, spec))
            out = llm.generate("Weather?", params)[0]
            assert out.finish_reason == "stop", (kind, out.text)
            assert re.fullmatch(patterns[kind], out.text), (kind, out.text)
            matcher, n = independent_matcher(ckpt, llm, llguidance.grammar_from(
                kind if kind != "grammar" else "lark", spec))
            assert_every_token_allowed(matcher, n, out.token_ids)


def test_mask_starts_after_the_open_think_block(llm, ckpt):
    tok = llm.engine.tokenizer
    start, end = (tok.hf.get_vocab()[t] for t in (THINK, END_THINK))
    bias = {end: 100.0}        # </think> would win every step it is allowed
    open_prompt = tok.encode("Question: the sea? " + THINK)
    assert open_prompt[-1] == start
    out = llm.generate(open_prompt, json_params(0, logit_bias=bias))[0]
    assert out.token_ids[0] == end                   # free while reasoning: </think> sampled
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text.split(END_THINK, 1)[1]), SCHEMA)
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_DEFAULTS)
    matcher, n = independent_matcher(ckpt, llm, grammar)
    assert_every_token_allowed(matcher, n, out.token_ids[1:])
    # Reasoning closed in the prompt, or never opened: the grammar applies from the first token.
    for prompt in ("Question: the sea? " + THINK + "hmm" + END_THINK, "Question: the sea?"):
        out = llm.generate(tok.encode(prompt), json_params(0, logit_bias=bias))[0]
        assert end not in out.token_ids
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_length_truncated_output_is_a_prefix_of_the_grammar(llm, ckpt):
    out = llm.generate("Sea?", json_params(3, max_tokens=5))[0]
    assert out.finish_reason == "length"
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_DEFAULTS)
    matcher, _ = independent_matcher(ckpt, llm, grammar)
    assert matcher.consume_tokens(out.token_ids)


# ---- the compiler

def test_compiler_caches_by_hash_and_names_errors(llm):
    compiler = llm.engine.structured_outputs().compiler
    a = StructuredOutputsParams("json", json_spec(SCHEMA))
    b = StructuredOutputsParams("json", json_spec(json.dumps(SCHEMA)))   # same text
    assert compiler.compile(a) is compiler.compile(b)
    bad = [("json", json_spec({"not": {"type": "string"}}), "Unimplemented keys"),
           ("json", json_spec({"type": "strange"}), "Invalid type"),
           ("json", json_spec({"type": "string", "format": "zip-code"}), "Unknown format"),
           ("regex", "[a-z", "unclosed character class"),
           ("regex", "(?<=a)b", "look-around"),
           ("grammar", "start: foo\nfoo: \"a\" bar", "unknown name"),
           ("choice", "[1, 2]", "choice")]
    for kind, spec, message in bad:
        with pytest.raises((ValueError, TypeError)) as e:
            compiler.compile(StructuredOutputsParams(kind, spec))
        assert message in str(e.value), (kind, spec, str(e.value))
    with pytest.raises(ValueError, match="not valid JSON"):
        json_spec("{nope")


def test_compiler_lru_is_bounded(llm):
    from engine.sampling.structured_outputs import GrammarCompiler
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               engine.eos_token_ids, cache_size=3)
    first = compiler.compile(StructuredOutputsParams("regex", "a0"))
    for i in range(1, 5):
        compiler.compile(StructuredOutputsParams("regex", f"a{i}"))
    assert compiler.cache_len() == 3
    again = compiler.compile(StructuredOutputsParams("regex", "a0"))
    assert again is not first                      # evicted, compiled anew


# ---- the server's compile step

def test_compile_timeout_is_a_400_naming_the_param():
    """A grammar still compiling after --structured-outputs-timeout fails its own request."""
    import asyncio
    from concurrent.futures import Future
    from types import SimpleNamespace

    from server.__main__ import build_parser, engine_config, server_settings
    from server.protocol import APIError, ChatCompletionRequest, parse_request
    from server.structured_outputs import prepare

    args = build_parser().parse_args(["--w", "/m", "--cpu", "--structured-outputs-timeout",
                                      "0.2"])
    settings = server_settings(args, engine_config(args))
    assert settings.structured_outputs_timeout == 0.2
    never = Future()                          # a compile that does not finish
    manager = SimpleNamespace(compiler=SimpleNamespace(submit=lambda so: never))
    engine = SimpleNamespace(structured_outputs=lambda: manager)
    req = parse_request(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}], "guided_regex": "a+"})
    params = SamplingParams()
    with pytest.raises(APIError) as e:
        asyncio.run(prepare(engine, req, [params], settings))
    assert e.value.param == "guided_regex" and "did not compile within 0.2 s" in e.value.message
    assert params.structured_outputs is None
