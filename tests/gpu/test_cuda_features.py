"""GPU checks of the serving features built after the first GPU window, each on the CUDA engine
against the CPU engine (which the CPU suites hold to transformers) or against the same CUDA engine
with the feature off, where what is tested is that the feature changes the output:

  speculative decoding  prompt-lookup drafts verified on the device (1 + k rows per sequence in
                        one forward, rejected rows' KV rolled back): greedy tokens equal the CPU
                        engine's without speculation up to its first near-tie, with drafts
                        accepted;
  draft model           the target as its own draft on the device (its own KV pool, mirrored
                        each step; k one-token forwards): greedy tokens equal the CPU engine's
                        without speculation up to its first near-tie, nearly every draft taken;
  EAGLE-3 head          a random head's drafts (the target's aux hidden states captured in the
                        device forward, the head's K/V and feature pools on the device, d2t):
                        greedy tokens equal the CPU engine's without speculation up to its first
                        near-tie, drafts proposed; the first drafts equal the CPU head's where its
                        top two logits are apart;
  reasoning budget      </think> forced through the per-row token bitmask on the device after k
                        reasoning tokens, beside an unbudgeted row of the same batch;
  token logits          a scoring request's logits of a few tokens at the prompt's last row (the
                        rerank path: rows and columns gathered on the device) equal the CPU's.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_model import TIE, checkpoints, compare, make_llm, random_prompts  # noqa: F401

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# repetition_penalty < 1 favours tokens seen before: the random model's output loops, which
# prompt lookup predicts several tokens at a time
LOOPY = dict(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=0.2)


@pytest.fixture
def free_drafts(monkeypatch):
    """The cost model (engine/spec/costs.py) decides from measured step times whether drafts
    pay; here they are free, so that acceptance alone decides what is proposed."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


def test_ngram_speculation_matches_cpu(checkpoints, free_drafts):
    from engine import SamplingParams

    path = checkpoints("llama")
    rng = np.random.default_rng(11)
    base = rng.integers(3, 500, 7).tolist()
    prompts = [base * 5, rng.integers(3, 500, 40).tolist(), base[:3] * 9 + [5, 9, 11]]
    # the CPU's margins after the penalty: the processed logprobs' top two
    cpu = make_llm(path, "cpu", logprobs_mode="processed")
    want = cpu.generate(prompts, SamplingParams(**LOOPY, logprobs=2))
    cuda = make_llm(path, "cuda", speculative_config=NGRAM)
    got = cuda.generate(prompts, SamplingParams(**LOOPY))
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"ngram prompt {i}", g.token_ids, w.token_ids,
                            top[:, 0] - top[:, 1])
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
    stats = cuda.engine.speculator.stats
    assert stats.num_accepted_tokens > 8, stats
    pool = cuda.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks        # rolled-back blocks all returned


def test_draft_model_speculation_matches_cpu(checkpoints, free_drafts):
    from engine import SamplingParams

    path = checkpoints("llama")
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    prompts = random_prompts(25, (9, 40, 23))     # the CPU's margins trust 84 of the 96 tokens
    cpu = make_llm(path, "cpu", logprobs_mode="processed")
    want = cpu.generate(prompts, SamplingParams(**LOOPY, logprobs=2))
    cuda = make_llm(path, "cuda", speculative_config=spec)
    got = cuda.generate(prompts, SamplingParams(**LOOPY))
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"draft_model prompt {i}", g.token_ids, w.token_ids,
                            top[:, 0] - top[:, 1])
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
    stats = cuda.engine.speculator.stats
    # the same weights draft as verify; a draft differs only at a near-tie of the two forwards'
    # bf16 sums (one token at a time against k + 1 rows)
    assert stats.num_draft_tokens > 24 and stats.acceptance_rate > 0.75, stats
    pool = cuda.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_eagle3_speculation_matches_cpu(checkpoints, free_drafts, tmp_path):
    from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
    from engine import SamplingParams

    path = checkpoints("llama")                       # tiny-256: 2 layers of hidden 256
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    head = write_head(tmp_path / "head", random_weights({**HEAD, **cfg}, num_aux=2),
                      draft_vocab(512, 384, seed=1), eagle_aux_hidden_state_layer_ids=[0, 1],
                      **cfg)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    prompts = random_prompts(13, (9, 40, 23))
    params = SamplingParams(**LOOPY)          # the penalty widens the random model's margins
    cpu = make_llm(path, "cpu", logprobs_mode="processed")
    want = cpu.generate(prompts, SamplingParams(**LOOPY, logprobs=2))
    first = {}

    def first_drafts(llm, name):
        proposer = llm.engine.speculator.draft_model
        step_logits = proposer._step_logits

        def spy(batch, tables, plans, live, rows, tokens, step):
            out = step_logits(batch, tables, plans, live, rows, tokens, step)
            if step == 0 and name not in first:
                first[name] = np.asarray(llm.engine.backend.to_host(out), np.float64)
            return out
        proposer._step_logits = spy

    cuda = make_llm(path, "cuda", speculative_config=spec)
    first_drafts(cuda, "cuda")
    got = cuda.generate(prompts, params)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"eagle3 prompt {i}", g.token_ids, w.token_ids,
                            top[:, 0] - top[:, 1])
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
    assert cuda.engine.speculator.stats.num_drafts > 0
    cpu_spec = make_llm(path, "cpu", speculative_config=spec)
    first_drafts(cpu_spec, "cpu")
    cpu_spec.generate(prompts, params)
    a, b = first["cuda"], first["cpu"]
    assert (np.isfinite(a) == np.isfinite(b)).all()          # the draft vocabulary's ids
    for row_cuda, row_cpu in zip(a, b):
        top = np.sort(row_cpu[np.isfinite(row_cpu)])[-2:]
        if top[1] - top[0] > 0.5:
            assert np.argmax(row_cuda) == np.argmax(row_cpu)


def test_reasoning_budget_forced_on_the_device(tmp_path):
    from engine import SamplingParams
    from test_reasoning_budget import END_THINK, THINK, budget_checkpoint

    cuda = make_llm(budget_checkpoint(tmp_path / "demo"), "cuda")
    tok = cuda.engine.tokenizer
    end = tok.hf.get_vocab()[END_THINK]
    prompt = tok.encode("Question: the sea?\n" + THINK + "\n")

    def greedy(**kw):
        return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                              skip_special_tokens=False, **kw)

    free = cuda.generate(prompt, greedy())[0]
    assert end not in free.token_ids                  # unbudgeted, the reasoning runs on
    for k in (0, 3):
        budgeted, plain = cuda.generate([prompt, prompt], [greedy(reasoning_budget=k), greedy()])
        assert budgeted.token_ids[:k] == free.token_ids[:k]
        assert budgeted.token_ids[k] == end != free.token_ids[k]
        assert plain.token_ids == free.token_ids      # its neighbour in the batch is untouched


def test_token_logits_match_cpu(checkpoints):
    from engine.sampling.pooling import PoolingParams

    path = checkpoints("qwen3_qk_norm")
    prompts = random_prompts(5, (30, 9, 45))
    ids = (17, 3, 400)
    # chunks of 8 tokens, 24 a step: each prompt's last row arrives in a later step, beside other
    # prompts' chunks and an embedding request's rows
    common = dict(prefill_chunk_size=8, max_num_batched_tokens=24)
    outs = {}
    for backend in ("cuda", "cpu"):
        llm = make_llm(path, backend, **common)
        got = llm.generate(prompts + [prompts[1]], [PoolingParams(token_ids=ids)] * 3
                           + [PoolingParams()])
        outs[backend] = np.stack([o.embedding for o in got[:3]]).astype(np.float64)
        assert outs[backend].shape == (3, len(ids))
    shifted = make_llm(path, "cpu", **common).generate(
        prompts, [PoolingParams(token_ids=tuple(t + 1 for t in ids))] * 3)
    shifted = np.stack([o.embedding for o in shifted])
    # bf16 activations against the CPU's f32 move these logits by well under TIE; a wrong row or
    # column moves them by the logits' own spread
    assert np.abs(shifted - outs["cpu"]).max() > 4 * TIE
    np.testing.assert_allclose(outs["cuda"], outs["cpu"], atol=TIE, rtol=0)
