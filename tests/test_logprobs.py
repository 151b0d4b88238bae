"""Logprobs, n > 1 and logit_bias in the engine (CPU backend), against transformers' logits on a
tiny float32 checkpoint: generated and prompt logprobs (across prefill chunks), top-k, processed
logprobs, choices equal to separate requests with seeds seed + i and the prompt computed once,
logit_bias forcing and banning tokens; and the token bytes of split characters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.logprobs import gather_logprobs
from tiny_llama import hf, model_dir  # noqa: F401 (fixtures)

TOL = 1e-4


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(3).integers(0, 500, 45).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits at every position, as float64."""
    return hf(torch.tensor([ids])).logits[0].double().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def top_ids(row: np.ndarray, k: int) -> list[int]:
    return np.argsort(-row, kind="stable")[:k].tolist()


def test_gather_logprobs_matches_a_float64_reference():
    from pyx.cpu_backend import CpuBackend
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, 300)).astype(np.float32)
    logits[1, [7, 50, 9]] = 9.0                       # a three-way tie: ranked by id
    logits[2, 100:] = -np.inf                         # a filtered row (processed logprobs)
    tokens = [3, 50, 4, 299, 0]
    chosen, rank, ids, lps = gather_logprobs(CpuBackend(), logits, tokens, 4)
    want = log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(chosen, want[np.arange(5), tokens], atol=1e-5)
    for r in range(5):
        assert ids[r].tolist() == top_ids(logits[r], 4)
        np.testing.assert_allclose(lps[r], want[r, ids[r]], atol=1e-5)
        assert rank[r] == 1 + int((logits[r] > logits[r, tokens[r]]).sum())
    assert ids[1, :3].tolist() == [7, 9, 50]


def test_top_k_equals_a_stable_sort():
    """The candidate-threshold top-k against NumPy's stable argsort: random rows, integer rows
    full of ties, rows mostly -inf (as filtered logits are), k from 0 to 25."""
    from pyx.cpu_backend import CpuBackend
    be, rng = CpuBackend(), np.random.default_rng(1)
    for trial in range(300):
        B, V = int(rng.integers(1, 6)), int(rng.integers(1, 3000))
        x = (rng.integers(-5, 5, (B, V)) if trial % 2 else rng.normal(0, 3, (B, V)))
        x = x.astype(np.float32)
        if trial % 3 == 0:
            x[0, rng.random(V) < 0.95] = -np.inf
        k = int(rng.integers(0, min(V, 25) + 1))
        ids = gather_logprobs(be, x, np.zeros(B, int), k)[2]
        assert (ids == np.argsort(-x, axis=1, kind="stable")[:, :k]).all(), trial


def test_logprobs_equal_transformers_across_prefill_chunks(model_dir, hf, prompt):
    """Greedy generation with logprobs=5 and prompt_logprobs=3, the 45-token prompt in chunks
    of 16: every logprob is transformers' log-softmax at that position (1e-4)."""
    llm = LLM(model_dir, block_size=8, prefill_chunk_size=16)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logprobs=5, prompt_logprobs=3))[0]
    ids = prompt + out.token_ids
    ref = log_softmax(hf_logits(hf, ids))
    P = len(prompt)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for i, e in enumerate(out.logprobs):
        row = ref[P - 1 + i]
        assert abs(e.logprob - row[e.token_id]) < TOL
        assert e.top_ids == top_ids(row, 5)
        np.testing.assert_allclose(e.top_logprobs, row[e.top_ids], atol=TOL)
        assert e.rank == 1       # greedy
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for j in range(1, P):
        e = out.prompt_logprobs[j]
        row = ref[j - 1]
        assert e.token_id == prompt[j] and abs(e.logprob - row[prompt[j]]) < TOL
        assert e.top_ids == top_ids(row, 3)
        assert e.rank == 1 + int((row > row[prompt[j]]).sum())
    # the raw logits are not logprobs: the comparison above could fail
    assert abs(hf_logits(hf, ids)[P - 1, out.token_ids[0]] - out.logprobs[0].logprob) > 0.1


def test_prompt_logprobs_skip_the_prefix_cache(model_dir, hf, prompt):
    """A cached prompt would skip computing the rows prompt logprobs need: such a request takes
    no prefix-cache hit and still gets every prompt token's logprob."""
    llm = LLM(model_dir, block_size=8)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    ref = log_softmax(hf_logits(hf, prompt))
    got = [e.logprob for e in out.prompt_logprobs[1:]]
    np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=TOL)
    # without prompt logprobs the same prompt hits the cache
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens == 40


def test_processed_logprobs_are_of_the_distribution_sampled(model_dir, hf, prompt):
    """logprobs_mode processed: log-softmax of logits / temperature with top-k's dropped tokens
    at -inf; raw mode gives the model's own distribution, which differs."""
    params = SamplingParams(temperature=0.7, top_k=6, seed=5, max_tokens=6, ignore_eos=True,
                            logprobs=3)
    raw = LLM(model_dir).generate([prompt], params)[0]
    processed = LLM(model_dir, logprobs_mode="processed").generate([prompt], params)[0]
    assert processed.token_ids == raw.token_ids        # logprobs never change the sampling
    logits = hf_logits(hf, prompt + raw.token_ids)
    P = len(prompt)
    for i, (r, p) in enumerate(zip(raw.logprobs, processed.logprobs)):
        row = logits[P - 1 + i]
        kept = np.full_like(row, -np.inf)
        keep = top_ids(row, 6)
        kept[keep] = row[keep] / 0.7
        want = log_softmax(kept)
        assert abs(p.logprob - want[p.token_id]) < TOL
        np.testing.assert_allclose(p.top_logprobs, want[p.top_ids], atol=TOL)
        assert abs(r.logprob - log_softmax(row)[r.token_id]) < TOL
        assert abs(p.logprob - r.logprob) > 1e-3


def test_n_choices_equal_separate_requests_and_share_the_prefill(model_dir, prompt):
    """n=3 with seed 11: choice i equals a request alone with seed 11 + i; choices 1 and 2 find
    the prompt's full blocks in the prefix cache, so the prompt is computed once."""
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model_dir, block_size=8)
    outs = llm.generate([prompt], SamplingParams(n=3, seed=11, **base))[0]
    assert [o.index for o in outs] == [0, 1, 2]
    for i, o in enumerate(outs):
        alone = LLM(model_dir, block_size=8).generate([prompt], SamplingParams(seed=11 + i,
                                                                               **base))[0]
        assert o.token_ids == alone.token_ids, i
    assert len({tuple(o.token_ids) for o in outs}) == 3     # the seeds differ
    stats, P = llm.engine.stats(), len(prompt)
    full = (P - 1) // 8 * 8           # a lookup never covers the last prompt token
    assert (stats.prefix_cache_hits, stats.prompt_tokens) == (2 * full, P)
    assert [o.num_cached_tokens for o in outs] == [0, full, full]
    # forward tokens: the prompt once, the two forks' uncached tails, then 5 decode steps each
    assert llm.engine.runner.num_forward_tokens == P + 2 * (P - full) + 3 * 5


def test_n_without_a_seed_gives_distinct_choices(model_dir, prompt):
    outs = LLM(model_dir).generate([prompt], SamplingParams(n=4, max_tokens=8, ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_logit_bias_forces_and_bans_tokens(model_dir, hf, prompt):
    """+100 on a token makes it every greedy choice; -100 on transformers' greedy token gives
    transformers' second choice."""
    logits = hf_logits(hf, prompt)[-1]
    first, second = top_ids(logits, 2)
    llm = LLM(model_dir)
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([prompt], SamplingParams(**greedy))[0].token_ids[0] == first
    banned = llm.generate([prompt], SamplingParams(logit_bias={first: -100}, **greedy))[0]
    assert banned.token_ids[0] == second
    forced = llm.generate([prompt], SamplingParams(logit_bias={321: 100}, **greedy))[0]
    assert forced.token_ids == [321] * 4
    with pytest.raises(ValueError, match="logit_bias: token id 512"):
        llm.generate([prompt], SamplingParams(logit_bias={512: 1.0}, **greedy))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})


def test_token_bytes_of_split_characters(bl, sp):
    """OpenAI's `bytes`: each token's own bytes, so a character split across tokens (🎉 in the
    byte-level BPE, every non-ASCII character in SentencePiece's byte fallback) is split across
    their bytes, and the bytes join into the text."""
    from server.logprobs import TokenText, chat_entries
    from engine.core.outputs import TokenLogprobs
    for tok, text in ((bl, "a😀🎉 café"), (sp, "hi 😀 café")):
        ids = tok.encode(text, add_special_tokens=False)
        entries = chat_entries([TokenLogprobs(i, -1.0) for i in ids], TokenText(tok))
        raw = [bytes(e["bytes"]) for e in entries]
        assert b"".join(raw).decode().strip() == text.strip()
        assert any(len(r) and not _is_utf8(r) for r in raw)   # some token holds a part
    party = bl.encode("🎉", add_special_tokens=False)
    assert [bl.token_bytes(i) for i in party] == [b"\xf0\x9f", b"\x8e", b"\x89"]
    assert bl.token_bytes(bl.bos_token_id) == bl.convert_ids_to_tokens([bl.bos_token_id])[0].encode()


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_abort_frees_every_choice_and_beam(model_dir, prompt):
    """Aborting an n=3 request while choice 0 prefills (its forks still waiting), or a beam
    search mid-way, reports every choice and frees every block."""
    llm = LLM(model_dir, block_size=8, prefill_chunk_size=16)
    engine = llm.engine
    total = engine.block_pool.num_free_blocks
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=4))
    engine.step()
    assert sorted(engine.abort("n3")) == [0, 1, 2]
    engine.add_request("beam", prompt, SamplingParams(use_beam_search=True, best_of=3, n=2,
                                                      max_tokens=8))
    for _ in range(5):      # 3 prefill chunks, then two beam steps
        engine.step()
    assert engine.abort("beam") == [0, 1]
    assert not engine.has_unfinished() and not engine.abort("beam")
    assert engine.block_pool.num_free_blocks == total
