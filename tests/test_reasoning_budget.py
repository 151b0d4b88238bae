"""The reasoning budget (engine/sampling/reasoning_budget.py): after `reasoning_budget` tokens of
reasoning the engine forces </think>, then samples the answer as usual. On the demo checkpoint
(random weights) with <think> / </think> added to its tokenizer: the same requests without a
budget show where the budget changes the output (the random model never closes its reasoning by
itself) and that it changes nothing else."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.core.sequence import Sequence
from engine.sampling.reasoning_budget import ReasoningBudget
from engine.sampling.sampler import Sampler
from pyx.cpu_backend import CpuBackend

pytestmark = pytest.mark.timeout(300)

THINK, END_THINK = "<think>", "</think>"
MAX_TOKENS = 16


def budget_checkpoint(directory) -> str:
    """The demo checkpoint written to `directory` with <think> and </think> added to its
    tokenizer (and rows for them in embed_tokens and lm_head). Also tests/gpu's."""
    from tokenizers import AddedToken, Tokenizer

    from server.demo_model import write_demo_checkpoint
    d = Path(write_demo_checkpoint(str(directory)))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens([AddedToken(THINK, special=True), AddedToken(END_THINK, special=True)])
    tok.save(str(d / "tokenizer.json"))
    # rows of embed_tokens and lm_head for the two new ids
    from safetensors.numpy import load_file, save_file
    V = tok.get_vocab_size()
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
    return str(d)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    d = budget_checkpoint(tmp_path_factory.mktemp("demo") / "demo")
    return LLM(d, backend="cpu", kv_cache_memory_mb=32)


def ids(llm) -> tuple[int, int]:
    vocab = llm.engine.tokenizer.hf.get_vocab()
    return vocab[THINK], vocab[END_THINK]


def open_prompt(llm) -> list[int]:
    """A prompt the template left inside <think> (as Qwen3's and DeepSeek-R1's do)."""
    prompt = llm.engine.tokenizer.encode("Question: the sea?\n" + THINK + "\n")
    assert prompt[-2] == ids(llm)[0]
    return prompt


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, skip_special_tokens=False, **kw)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_budget_closes_open_reasoning_after_k_tokens(llm, k):
    _, end = ids(llm)
    prompt = open_prompt(llm)
    free = llm.generate(prompt, greedy())[0]
    assert end not in free.token_ids               # unbudgeted, the reasoning runs on
    out = llm.generate(prompt, greedy(reasoning_budget=k))[0]
    assert out.token_ids[:k] == free.token_ids[:k]  # k tokens of the same reasoning
    assert out.token_ids[k] == end                   # then </think>, forced
    assert out.token_ids[k] != free.token_ids[k]
    assert len(out.token_ids) == MAX_TOKENS          # and the answer goes on after it
    assert END_THINK in out.text


def test_forced_token_logprob_is_its_own(llm):
    _, end = ids(llm)
    prompt = open_prompt(llm)
    k = 3
    free = llm.generate(prompt, greedy(logprobs=2))[0]
    out = llm.generate(prompt, greedy(logprobs=2, reasoning_budget=k))[0]
    forced = out.logprobs[k]
    assert forced.token_id == end
    # the raw logprob of </think> there: finite, below the greedy choice's, not the mask's 0
    assert math.isfinite(forced.logprob) and forced.logprob < free.logprobs[k].logprob
    assert forced.rank > 1


def test_batch_neighbours_and_closed_prompts_unchanged(llm):
    """In one batch: a budgeted request, an unbudgeted one (as it is alone), and budgeted ones
    whose prompt closed its reasoning or never opened it (nothing forced)."""
    _, end = ids(llm)
    tok = llm.engine.tokenizer
    opened = open_prompt(llm)
    closed = tok.encode("Question: the sea?\n" + THINK + "hmm" + END_THINK + "\n")
    plain = tok.encode("Question: the sea?")
    alone = [llm.generate(p, greedy())[0].token_ids for p in (opened, closed, plain)]
    outs = llm.generate([opened, opened, closed, plain],
                        [greedy(reasoning_budget=2), greedy(), greedy(reasoning_budget=0),
                         greedy(reasoning_budget=0)])
    assert outs[0].token_ids[2] == end
    assert [o.token_ids for o in outs[1:]] == alone


def test_reasoning_the_model_opens_itself(llm):
    """No <think> in the prompt: the budget counts from the <think> the model writes."""
    start, end = ids(llm)
    plain = llm.engine.tokenizer.encode("Question: the sea?")
    bias = {start: 100.0}           # <think> wins every step it is free to
    free = llm.generate(plain, greedy(logit_bias=bias))[0]
    assert free.token_ids == [start] * MAX_TOKENS
    out = llm.generate(plain, greedy(logit_bias=bias, reasoning_budget=4))[0]
    # <think>, 4 reasoning tokens, </think>, then the answer (not forced again)
    assert out.token_ids == [start] * 5 + [end] + [start] * (MAX_TOKENS - 6)


def test_sampled_choices_each_close_at_the_budget(llm):
    _, end = ids(llm)
    prompt = open_prompt(llm)
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=MAX_TOKENS,
                            reasoning_budget=6)
    free = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, n=3,
                                               max_tokens=MAX_TOKENS))[0]
    outs = llm.generate(prompt, params)[0]
    closed_itself = [end in f.token_ids[:6] for f in free]
    assert closed_itself == [False, False, True]   # the third samples </think> at its 5th
    for f, o, own in zip(free, outs, closed_itself):
        if own:                          # within its budget: nothing forced
            assert o.token_ids == f.token_ids
        else:
            assert o.token_ids[:6] == f.token_ids[:6]
            assert o.token_ids[6] == end and f.token_ids[6] != end


def test_sampler_forces_the_row_on_any_path():
    """The sampler alone: a forcing row takes the closing token whatever its logits, greedy or
    sampled, with penalties; its neighbour row is untouched."""
    V = 100
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, V)).astype(np.float32)
    logits[0, 42] = -30.0             # the forced token is the least likely
    for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9, seed=1,
                                           repetition_penalty=1.3, logit_bias={42: -100.0})):
        seqs = [Sequence([1, 2, 3], SamplingParams(reasoning_budget=0, **kw)),
                Sequence([1, 2, 3], SamplingParams(**kw))]
        seqs[0].reasoning_budget = ReasoningBudget(0, [7], [42, 43], opened=True)
        sampler = Sampler(CpuBackend())
        alone = sampler.sample(logits[1:], seqs[1:], set())
        first = sampler.sample(logits, seqs, set())
        assert first[0] == 42 and first[1] == alone[0]
        seqs[0].reasoning_budget.advance(42)
        assert sampler.sample(logits, seqs, set())[0] == 43     # a two-token </think>
        seqs[0].reasoning_budget.advance(43)
        assert seqs[0].reasoning_budget.forced_token() is None


def test_budget_state_machine():
    b = ReasoningBudget(2, [7], [8, 9], opened=False)
    for t in (5, 7, 1):                 # a leading token, <think>, one reasoning token
        assert b.forced_token() is None
        b.advance(t)
    b.advance(8)                         # the model begins </think> as its budget ends
    assert b.forced_token() == 9         # forcing goes on from there
    b.advance(9)
    assert b.state == "done" and b.forced_token() is None
    late = ReasoningBudget(1, [7], [8], opened=False)
    for t in (1, 2, 3, 7, 4):            # <think> after the answer began: not reasoning
        late.advance(t)
    assert late.forced_token() is None
    closed = ReasoningBudget(3, [7], [8], opened=True)
    for t in (1, 8, 2, 3, 4):            # closed by the model itself within the budget
        closed.advance(t)
    assert closed.forced_token() is None


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="reasoning_budget must be non-negative"):
        SamplingParams(reasoning_budget=-1)
    with pytest.raises(ValueError, match="reasoning_budget is not supported with beam search"):
        SamplingParams(reasoning_budget=4, use_beam_search=True, best_of=2)
